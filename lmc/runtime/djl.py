"""The handler in DJL Serving's Python-engine shape, so an lmc artifact also runs in a stock LMI container.

DJL calls `handle(inputs)` with a djl_python Input: first an empty one (warm-up: load the model), then
batches (`get_batches()`, one Input per request, each `get_as_json()` an LMI body). The answer is one
Output with a JSON result per batch index; a malformed request fails alone (400), a model failure
fails its whole batch (424, the DJL convention). Streaming bodies are answered whole: DJL's own
streaming protocol is not implemented here (`lmc runtime` streams).

In DJL's MPI mode every TP rank runs this handler: the rank comes from RANK / OMPI_COMM_WORLD_RANK
and torch.distributed is initialised from MASTER_ADDR / MASTER_PORT before the engine loads.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from lmc.runtime.engines.base import Engine, GenerationRequest
from lmc.runtime.requests import lmi_details, parse_invocation

log = logging.getLogger(__name__)


class _Output:
    """The subset of djl_python.outputs.Output used here, for running without djl_python."""

    def __init__(self):
        self.code = 200
        self.message = ""
        self.properties: dict[str, str] = {}
        self.content: dict[Any, Any] = {}

    def add_property(self, key: str, value: str):
        self.properties[key] = value
        return self

    def add_as_json(self, value, key=None, batch_index=None):
        self.content[batch_index if batch_index is not None else key] = json.dumps(value, ensure_ascii=False)
        return self

    def error(self, error: str, code: int = 424, message: str = "prediction failure"):
        self.code, self.message = code, message
        self.content[None] = json.dumps({"code": code, "message": message, "error": error})
        return self


def _output_class():
    try:
        from djl_python.outputs import Output
    except ImportError:
        return _Output
    return Output


def env_rank() -> tuple[int, int]:
    """(rank, world size) as DJL's MPI mode (Open MPI) or torchrun sets them."""
    rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    return int(rank), int(world)


class DJLHandler:
    """`handle(inputs)` for djl_python; `create_engine_fn()` returns the (unloaded) engine the plan chose."""

    def __init__(self, create_engine_fn: Callable[[], Engine], *, max_sequence_length: int | None = None):
        self._create_engine = create_engine_fn
        self.engine: Engine | None = None
        self.max_sequence_length = max_sequence_length
        self.output_class = _output_class()

    def __call__(self, inputs):
        return self.handle(inputs)

    def initialize(self, properties: dict) -> None:
        model_dir = Path(properties.get("model_dir") or os.environ.get("MODEL_DIR") or "/opt/ml/model")
        rank, world = env_rank()
        if world > 1:
            _init_distributed(rank, world)
        engine = self._create_engine()
        engine.load(model_dir, rank, world)
        if self.max_sequence_length is None:
            self.max_sequence_length = getattr(engine, "max_sequence_length", None)
        self.engine = engine
        log.info("lmc DJL handler ready: rank %d of %d, model %s", rank, world, model_dir)

    def handle(self, inputs):
        if self.engine is None:
            self.initialize(inputs.get_properties())
        if inputs.is_empty():
            return None  # the warm-up call: loading was the point
        items = inputs.get_batches() if hasattr(inputs, "get_batches") else [inputs]
        output = self.output_class()
        parsed: list[tuple[int, list[str], Any, bool]] = []
        for index, item in enumerate(items):
            try:
                prompts, params, _stream, details = parse_invocation(item.get_as_json(), self.max_sequence_length)
                for prompt in prompts:
                    _check_length(self.engine, prompt, params.max_new_tokens, self.max_sequence_length)
            except ValueError as exc:
                _item_error(output, index, 400, str(exc))
                continue
            except Exception as exc:  # an unreadable body (not JSON)
                _item_error(output, index, 400, f"the request body is not valid JSON: {exc}")
                continue
            body = item.get_as_json()
            parsed.append((index, prompts, params, isinstance(body.get("inputs"), list), details))
        requests = [GenerationRequest(f"{index}/{n}", prompt, params)
                    for index, prompts, params, *_ in parsed for n, prompt in enumerate(prompts)]
        try:
            results = {r.id: r for r in self.engine.generate(requests)} if requests else {}
        except Exception as exc:
            log.exception("generation failed")
            for index, *_ in parsed:
                _item_error(output, index, 424, f"model failure: {type(exc).__name__}: {exc}")
            return output
        for index, prompts, _params, was_list, details in parsed:
            texts = [{"generated_text": results[f"{index}/{n}"].text} for n in range(len(prompts))]
            if details:
                for n, (text, prompt) in enumerate(zip(texts, prompts)):
                    text["details"] = lmi_details(prompt, results[f"{index}/{n}"])
            output.add_as_json(texts if was_list else texts[0], batch_index=index)
        return output


def _check_length(engine, prompt: str, max_new_tokens: int, max_sequence_length: int | None) -> None:
    n = engine.count_tokens(prompt)
    if n == 0:
        raise ValueError("the prompt is empty after tokenization; give at least one token of input")
    if max_sequence_length is not None and n + max_new_tokens > max_sequence_length:
        raise ValueError(f"the prompt is {n} tokens and max_new_tokens is {max_new_tokens}: {n + max_new_tokens} "
                         f"exceeds the maximum sequence length {max_sequence_length}")


def _item_error(output, index: int, code: int, message: str) -> None:
    output.add_property(f"batch_{index}_Content-Type", "application/json")
    output.add_as_json({"error": message, "code": code}, batch_index=index)


def _init_distributed(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world)
