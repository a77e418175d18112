"""The deepspeed engine: rank-local model from the shard, wrapped by DeepSpeed-Inference; CPU paths over gloo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

try:
    from _engine_helpers import build_artifact, hf_greedy, make_checkpoint, run_tp_ranks
except ImportError:  # tests/ imported as a package
    from tests._engine_helpers import build_artifact, hf_greedy, make_checkpoint, run_tp_ranks

from lmc.errors import MissingDependencyError
from lmc.runtime.engines import create_engine
from lmc.runtime.engines.base import GenerationParams, GenerationRequest
from lmc.runtime.engines.deepspeed import kernel_injection

PROMPTS = ["the quick brown", "héllo wörld, large models are served"]


def _engine(family, tp, device="cpu", dtype="fp32"):
    return create_engine("deepspeed", family=family, task="text-generation", dtype=dtype, tensor_parallel_degree=tp,
                         max_sequence_length=128, batch_size=4, device=device)


def _requests(n=8):
    return [GenerationRequest(str(i), p, GenerationParams(max_new_tokens=n)) for i, p in enumerate(PROMPTS)]


def test_missing_deepspeed_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(MissingDependencyError) as excinfo:
        _engine("llama", 1).load(tmp_path, 0, 1)
    assert str(excinfo.value).startswith("the deepspeed engine needs the `deepspeed` package: pip install deepspeed")
    assert "\n" not in str(excinfo.value)


def test_kernel_injection_only_on_cuda_for_known_families_with_whole_models():
    from lmc.planner.engines import engine_facts

    facts = engine_facts()["deepspeed"]
    injecting = facts.model_copy(update={"kernel_injection": True})
    assert injecting.fused("gptj") and injecting.fused("llama") and not injecting.fused("t5")
    # DeepSpeed 0.19.8's policies do not fit transformers 5's modules (seen on an H200): lmc injects none.
    assert facts.kernel_injection is False and not facts.fused("llama")
    assert not kernel_injection("llama", "cuda", 1) and not kernel_injection("gptj", "cuda", 1)
    assert not kernel_injection("llama", "cpu", 1)
    assert not kernel_injection("gptj", "cuda", 2)


def test_the_injection_policies_still_do_not_fit_transformers_modules():
    """What engines.toml's `kernel_injection = false` rests on, checked without a GPU: DeepSpeed's
    GPT-NeoX policy reads `attention.hidden_size`, which transformers' GPTNeoXAttention no longer has.
    When an upgrade brings it back, this fails: try injection on a GPU again (bench/gpu/device_check.sh)."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

    from lmc.testing.checkpoints import config_for

    import deepspeed

    source = Path(deepspeed.__file__).parent / "module_inject" / "containers" / "gptneox.py"
    assert "attention.hidden_size" in source.read_text()
    attention = GPTNeoXAttention(config_for("gpt_neox"), layer_idx=0)
    assert not hasattr(attention, "hidden_size")


def _rank_main(rank: int, opened: list[str], artifact: str) -> dict:
    import deepspeed

    engine = _engine("gpt_neox", 2)
    engine.load(artifact, rank, 2)
    shm_loaded = hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")
    return {"tokens": [r.token_ids for r in engine.generate(_requests())], "shm_loaded": shm_loaded,
            "shm_compatible": deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]}


def test_deepspeed_tp1_and_tp2_over_gloo_equal_hf_generate(tmp_path):
    checkpoint = make_checkpoint("gpt_neox", tmp_path / "ckpt")
    reference = [hf_greedy(checkpoint, prompt, 8) for prompt in PROMPTS]

    single = _engine("gpt_neox", 1)
    single.load(build_artifact(checkpoint, tmp_path / "tp1", 1), 0, 1)
    assert [r.token_ids for r in single.generate(_requests())] == reference
    assert single.ds_engine is not None

    artifact = build_artifact(checkpoint, tmp_path / "tp2", 2)
    results = run_tp_ranks(_rank_main, str(artifact))  # exit codes 0: no SIGSEGV from the SHM all-reduce
    assert results[0]["tokens"] == results[1]["tokens"] == reference
    # DeepSpeed's CPU shared-memory all-reduce op is marked unusable and was never loaded
    assert results[0]["shm_compatible"] is False and results[0]["shm_loaded"] is False


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_on_cuda_deepspeed_wraps_without_injection_and_tracks_hf(tmp_path, family):
    """On CUDA at TP 1 (where kernel injection used to be tried): DeepSpeed wraps the model as AutoTP, the
    greedy answers follow hf's, and rows may leave the batch (no fused KV workspace)."""
    checkpoint = make_checkpoint(family, tmp_path / "ckpt")
    engine = _engine(family, 1, device="cuda", dtype="fp16")
    engine.load(build_artifact(checkpoint, tmp_path / "art", 1), 0, 1)
    assert engine.ds_engine is not None and engine.compact_batches is True
    results = engine.generate(_requests(4))
    reference = [hf_greedy(checkpoint, prompt, 4) for prompt in PROMPTS]
    # fp16 on the GPU is not bit-identical to eager fp32: the first token must agree
    assert [r.token_ids[:1] for r in results] == [ref[:1] for ref in reference]
    mixed = engine.generate(_requests(4)[:1] + _requests(2)[1:])
    assert [len(r.token_ids) for r in mixed] == [len(reference[0]), len(hf_greedy(checkpoint, PROMPTS[1], 2))]
