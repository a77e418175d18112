"""Engine construction. Engines import torch and their SDKs lazily: importing this package is cheap."""

from __future__ import annotations

from lmc.errors import InternalError
from lmc.runtime.engines.base import Engine

ENGINES = ("hf", "deepspeed", "neuronx")
DEVICES = ("cpu", "cuda", "neuron")


def create_engine(engine: str, *, family: str, task: str, dtype: str, tensor_parallel_degree: int,
                  max_sequence_length: int, batch_size: int, device: str) -> Engine:
    """The engine the plan chose, not yet loaded: call `load(model_dir, rank, world_size)` next."""
    if device not in DEVICES:
        raise InternalError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    if tensor_parallel_degree < 1 or max_sequence_length < 2 or batch_size < 1:
        raise InternalError(f"engine sizes out of range: tp={tensor_parallel_degree}, "
                            f"max_sequence_length={max_sequence_length}, batch_size={batch_size}")
    kwargs = dict(family=family, task=task, dtype=dtype, tensor_parallel_degree=tensor_parallel_degree,
                  max_sequence_length=max_sequence_length, batch_size=batch_size, device=device)
    if engine == "hf":
        from lmc.runtime.engines.hf import HFEngine

        return HFEngine(**kwargs)
    if engine == "deepspeed":
        from lmc.runtime.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(**kwargs)
    if engine == "neuronx":
        from lmc.runtime.engines.neuronx import NeuronxEngine

        return NeuronxEngine(**kwargs)
    raise InternalError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


__all__ = ["create_engine", "ENGINES", "DEVICES"]
