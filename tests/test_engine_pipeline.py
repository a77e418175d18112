"""The pipeline engine at 2 stages x TP 2 (four processes over gloo): greedy = HF generate on the whole
checkpoint for a batch of prompts of different lengths whose rows finish at different steps, on both TP
ranks of stage 0; each process opens only its own stage's shard."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from _engine_helpers import free_port, hf_greedy, make_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["the quick brown", "héllo wörld, large models are served", "a"]
NEW_TOKENS = [10, 4, 7]
STAGES, TP = 2, 2


def _artifact(checkpoint: Path, out: Path) -> Path:
    from lmc.emitters.checkpoint import validate_checkpoint
    from lmc.emitters.partition import partition_pipeline
    from lmc.planner.checkpoint_facts import checkpoint_model_facts

    out.mkdir(parents=True)
    for item in checkpoint.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, out / item.name)
    facts = checkpoint_model_facts(checkpoint, "t/llama")
    partition_pipeline(validate_checkpoint(checkpoint, facts), family="llama", dtype="fp32", tp=TP, stages=STAGES,
                       layers=facts.layers, head_dim=facts.head_dim, kv_heads=facts.kv_heads, out_dir=out,
                       progress=False)
    return out


def _process(index: int, port: int, artifact: str, queue) -> None:
    import sys

    from lmc.runtime.engines.base import GenerationParams, GenerationRequest
    from lmc.runtime.engines.pipeline import create_pipeline_engine, init_stage_groups
    from lmc.runtime.engines.tp import leave_process_group
    from lmc.runtime.rendezvous import PipelineRole

    torch.set_num_threads(1)
    opened: list[str] = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and
                     str(args[0]).endswith(".safetensors") else None)
    stage, rank = divmod(index, TP)
    role = PipelineRole(stage=stage, stages=STAGES, tp=TP, leader_address="127.0.0.1", port=port, timeout_s=60)
    plan = {"model": {"family": "llama"}, "dtype": "fp32", "tensor_parallel_degree": TP, "max_sequence_length": 128,
            "batch_size": 4, "target": {"accelerator": "cpu"}}
    engine = create_pipeline_engine(plan, "text-generation", role, init_stage_groups(role, rank, "gloo"))
    engine.load(Path(artifact), rank, TP)
    tokens = None
    try:
        if stage == 0:
            results = engine.generate([GenerationRequest(str(i), prompt, GenerationParams(max_new_tokens=n))
                                       for i, (prompt, n) in enumerate(zip(PROMPTS, NEW_TOKENS))])
            engine.heartbeat()  # the other stages pass it on and keep waiting
            tokens = [result.token_ids for result in results]
            tokens += [result.token_ids for result in engine.generate([GenerationRequest("again", PROMPTS[1])])]
            engine.shutdown()
        else:
            engine.serve_stage()
    finally:
        queue.put((index, tokens, [Path(p).name for p in opened]))
        leave_process_group()


def test_two_stages_of_tp2_decode_as_hf_generate(tmp_path):
    import torch.multiprocessing as mp

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt", num_hidden_layers=3)
    artifact = _artifact(checkpoint, tmp_path / "artifact")
    context = mp.get_context("spawn")
    queue, port = context.Queue(), free_port()
    processes = [context.Process(target=_process, args=(i, port, str(artifact), queue)) for i in range(STAGES * TP)]
    for process in processes:
        process.start()
    reports = {index: (tokens, opened) for index, tokens, opened in (queue.get(timeout=240) for _ in processes)}
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0] * len(processes)
    expected = [hf_greedy(checkpoint, prompt, n) for prompt, n in zip(PROMPTS, NEW_TOKENS)]
    expected.append(hf_greedy(checkpoint, PROMPTS[1], 32))
    assert reports[0][0] == expected
    assert reports[1][0] == expected  # stage 0's other TP rank, in lockstep
    for index, (_, opened) in reports.items():
        stage, rank = divmod(index, TP)
        assert opened == [f"stage{stage}-rank{rank}.safetensors"]
