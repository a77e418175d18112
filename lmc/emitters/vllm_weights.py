"""vLLM artifacts' weights: vLLM's own `sharded_state` files, written by vLLM at build time.

`load_format=sharded_state` makes each rank read its own `model-rank-{rank}-part-{part}.safetensors`
(vLLM's ShardedStateLoader), so loading never re-partitions. Only vLLM can write them (they hold its
parameter layout: fused qkv_proj, gate_up_proj), so the build starts vLLM on the checkpoint with the
planned TP degree and asks every worker to save its state
(`LLM.collective_rpc("save_sharded_state", ...)`, vLLM 0.32: vllm/v1/worker/gpu_worker.py).

That needs CUDA GPUs for the TP degree on the build machine. Without them, and always on CPU (vLLM's
CPU round trip is broken: saving writes only embeddings and norms, loading fails with missing keys),
the artifact carries the checkpoint in the planned dtype as `model.safetensors` and vLLM partitions
it as it loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from lmc.errors import ArtifactError
from lmc.manifest import VLLM_SHARDED_STATE
from lmc.planner.plan import Plan

SHARDED_PATTERN = VLLM_SHARDED_STATE  # vLLM's TP-only default pattern
SHARD_MAX_BYTES = 5 * 2**30  # parts of at most 5 GiB, as vLLM's save_sharded_state example
# lmc's name of vLLM's --dtype.
LMC_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def packed_dtype(plan: Plan) -> str | None:
    """The dtype of the weights a vLLM artifact carries: the plan's, 16-bit for fp8 (vLLM quantizes as it
    loads); None for a quantized checkpoint, whose files go in as they are."""
    if plan.model.checkpoint_quantization is not None:
        return None
    return "bf16" if plan.dtype == "fp8" else plan.dtype


def sharded_state_unavailable(plan: Plan) -> str | None:
    """None when this machine can write vLLM's sharded_state for `plan`; else why not (one line)."""
    if plan.target.accelerator == "cpu":
        return "vLLM's sharded_state round trip is broken on CPU"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed on this build machine"
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < plan.tensor_parallel_degree:
        return (f"vLLM needs {plan.tensor_parallel_degree} CUDA GPU(s) to write sharded_state for tensor parallel "
                f"degree {plan.tensor_parallel_degree}; this build machine has {have}")
    return None


def engine_arguments(plan: Plan, checkpoint: Path) -> dict[str, Any]:
    """vLLM's LLM(...) arguments for loading `checkpoint` as the plan serves it (one replica)."""
    assert plan.vllm is not None, "a vLLM plan has a vllm section"
    arguments: dict[str, Any] = {
        "model": str(checkpoint),
        "tensor_parallel_size": plan.tensor_parallel_degree,
        "dtype": plan.vllm.dtype,
        "max_model_len": plan.vllm.max_model_len,
        "max_num_seqs": plan.vllm.max_num_seqs,
        "gpu_memory_utilization": plan.vllm.gpu_memory_utilization,
        "enforce_eager": True,  # saving needs the weights, not compiled graphs
    }
    if plan.vllm.quantization:
        arguments["quantization"] = plan.vllm.quantization
    if plan.vllm.enable_expert_parallel:
        arguments["enable_expert_parallel"] = True
    return arguments


def write_sharded_state(plan: Plan, checkpoint: Path, out_dir: Path) -> list[str]:
    """Start vLLM on `checkpoint` and have every rank save its state into `out_dir` (which must exist).
    Returns the files written, sorted. Raises ArtifactError when vLLM fails or writes no rank's file."""
    from vllm import LLM

    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(p.name for p in out_dir.iterdir())
    llm = None
    try:
        llm = LLM(**engine_arguments(plan, checkpoint))
        llm.collective_rpc("save_sharded_state",
                           kwargs={"path": str(out_dir), "pattern": SHARDED_PATTERN, "max_size": SHARD_MAX_BYTES})
    except Exception as exc:  # vLLM's errors are many kinds; the build reports one line
        raise ArtifactError(f"vLLM could not write sharded_state for {checkpoint}: {type(exc).__name__}: {exc}") from None
    finally:  # stop the engine's worker processes now: they hold the GPUs until then
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
    written = sorted(p.name for p in out_dir.iterdir() if p.name not in before)
    missing = [rank for rank in range(plan.tensor_parallel_degree)
               if SHARDED_PATTERN.format(rank=rank, part=0) not in written]
    if missing:
        raise ArtifactError(f"vLLM's save_sharded_state wrote no file for rank(s) {missing} in {out_dir}")
    return written
