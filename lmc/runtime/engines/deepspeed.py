"""The `deepspeed` engine: DeepSpeed-Inference over the rank-local model the hf engine builds.

Design (keeps "each rank reads only its own shard"): the model is built and filled from this rank's
pre-partitioned shard exactly as in the hf engine (same surgery, same torch.distributed collectives),
then handed to `deepspeed.init_inference` with tp_size=1, so DeepSpeed never re-partitions or reloads
weights. On CUDA at TP=1, families DeepSpeed has fused kernels for would get kernel injection, but
lmc injects none today: DeepSpeed 0.19.8's injection policies do not fit transformers 5's modules (seen
on an H200; engines.toml, `kernel_injection`), so every family runs as AutoTP. At TP>1 the
rank-local modules already hold a slice of the heads, which DeepSpeed's injection policies (reading
the full head count from the config) would misinterpret, so there DeepSpeed wraps the model without
injection and the TP collectives stay ours. On the CPU DeepSpeed never injects kernels.

On the CPU, DeepSpeed's just-in-time-built shared-memory all-reduce op is switched off before its
communication backend starts: with it, TP ranks over gloo die with SIGSEGV (observed with deepspeed
0.19.8). The knob is DeepSpeed's own op-compatibility table (`deepspeed.ops.__compatible_ops__`),
which `build_shm_op` consults before building the op.
"""

from __future__ import annotations

import logging

from lmc.errors import MissingDependencyError
from lmc.runtime.engines.hf import HFEngine

log = logging.getLogger(__name__)

SHM_OP = "deepspeed_shm_comm"


def import_deepspeed():
    try:
        import deepspeed
    except ImportError:
        raise MissingDependencyError("the deepspeed engine needs the `deepspeed` package: pip install deepspeed "
                                     "(in the serving container; the LMI DeepSpeed images ship it)") from None
    return deepspeed


def disable_shm_allreduce(deepspeed) -> None:
    """Mark DeepSpeed's CPU shared-memory all-reduce op incompatible so its backend never builds it."""
    compatible = deepspeed.ops.__compatible_ops__  # first access probes; the dict persists and is consulted later
    compatible[SHM_OP] = False


def kernel_injection(family: str, device: str, tp: int) -> bool:
    """Fused kernels only where DeepSpeed has them, lmc injects them (the engine facts: not with
    transformers 5), and the model is whole on the rank (see module doc)."""
    from lmc.planner.engines import engine_facts

    return device == "cuda" and tp == 1 and engine_facts()["deepspeed"].fused(family)


class DeepSpeedEngine(HFEngine):
    name = "deepspeed"

    def load(self, model_dir, rank: int, world_size: int) -> None:
        deepspeed = import_deepspeed()
        if self.device_kind == "cpu":
            disable_shm_allreduce(deepspeed)
        self._deepspeed = deepspeed
        super().load(model_dir, rank, world_size)

    def _finish(self, model, compute_dtype, device):
        model = super()._finish(model, compute_dtype, device)
        inject = kernel_injection(self.family, self.device_kind, self.tp)
        engine = self._deepspeed.init_inference(model, tensor_parallel={"tp_size": 1}, dtype=compute_dtype,
                                                replace_with_kernel_inject=inject)
        self.compact_batches = not inject  # the fused kernels keep the KV cache in DeepSpeed's workspace
        log.info("deepspeed inference engine ready (kernel injection %s)", "on" if inject else "off")
        self.ds_engine = engine
        return engine.module
