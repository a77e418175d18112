"""The deepspeed engine: rank-local model from the shard, wrapped by DeepSpeed-Inference; CPU paths over gloo."""

from __future__ import annotations

import sys

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
    assert kernel_injection("gptj", "cuda", 1)
    assert kernel_injection("llama", "cuda", 1)
    assert not kernel_injection("llama", "cpu", 1)
    assert not kernel_injection("t5", "cuda", 1)
    assert not kernel_injection("gptj", "cuda", 2)


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
def test_kernel_injection_on_cuda_tracks_hf(tmp_path, family):
    checkpoint = make_checkpoint(family, tmp_path / "ckpt")
    engine = _engine(family, 1, device="cuda", dtype="fp16")
    engine.load(build_artifact(checkpoint, tmp_path / "art", 1), 0, 1)
    results = engine.generate(_requests(4))
    reference = [hf_greedy(checkpoint, prompt, 4) for prompt in PROMPTS]
    # fused fp16 kernels are not bit-identical to eager fp32: the first token must agree
    assert [r.token_ids[:1] for r in results] == [ref[:1] for ref in reference]
    # The fused kernels keep the KV cache in DeepSpeed's workspace: finished rows must stay in the batch.
    assert engine.compact_batches is False
    mixed = engine.generate(_requests(4)[:1] + _requests(2)[1:])
    assert [len(r.token_ids) for r in mixed] == [len(reference[0]), len(hf_greedy(checkpoint, PROMPTS[1], 2))]
