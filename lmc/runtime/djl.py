"""The handler in DJL Serving's Python-engine shape, so an lmc artifact also runs in a stock LMI container.

DJL calls `handle(inputs)` with a djl_python Input: first an empty one (warm-up: load the model), then
batches (`get_batches()`, one Input per request, each `get_as_json()` an LMI body). The answer is one
Output with a JSON result per batch index; a malformed request fails alone (400), a model failure
fails its whole batch (424, the DJL convention).

Streaming (`"stream": true`) answers LMI's jsonlines, the lines `lmc runtime` sends. DJL streams a
whole Output, not one request of a batch, so a streaming request that came alone (batch of one, always
so with batch_size 1) is streamed as it is generated (`Output.add_stream_content`); one batched with
others gets the same lines at once, when its batch is done.

In DJL's MPI mode every TP rank runs this handler: the rank comes from RANK / OMPI_COMM_WORLD_RANK
and torch.distributed is initialised from MASTER_ADDR / MASTER_PORT before the engine loads.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from lmc.runtime.engines.base import Engine, GenerationParams, GenerationRequest, Piece
from lmc.runtime.requests import LmiLines, check_logit_bias, jsonline, lmi_details, parse_invocation

log = logging.getLogger(__name__)

JSONLINES = "application/jsonlines"


class _Output:
    """The subset of djl_python.outputs.Output used here, for running without djl_python."""

    def __init__(self):
        self.code = 200
        self.message = ""
        self.properties: dict[str, str] = {}
        self.content: dict[Any, Any] = {}
        self.stream_content: Iterator[Any] | None = None
        self.stream_output_formatter = None

    def add_property(self, key: str, value: str):
        self.properties[key] = value
        return self

    def add(self, value, key=None, batch_index=None):
        self.content[batch_index if batch_index is not None else key] = value
        return self

    def add_as_json(self, value, key=None, batch_index=None):
        return self.add(json.dumps(value, ensure_ascii=False), key, batch_index)

    def add_stream_content(self, stream_content, output_formatter=None):
        self.stream_content, self.stream_output_formatter = stream_content, output_formatter
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


@dataclass(frozen=True)
class _Item:
    """One parsed request of a batch: its batch index, prompts (one per answer) and how to answer."""

    index: int
    prompts: list[str]
    params: GenerationParams
    was_list: bool
    stream: bool
    details: bool

    def request(self, n: int) -> GenerationRequest:
        return GenerationRequest(f"{self.index}/{n}", self.prompts[n], self.params)


class DJLHandler:
    """`handle(inputs)` for djl_python; `create_engine_fn()` returns the (unloaded) engine the plan chose."""

    def __init__(self, create_engine_fn: Callable[[], Engine], *, max_sequence_length: int | None = None,
                 verify: bool = False):
        self._create_engine = create_engine_fn
        self.verify = verify  # check the artifact against its lmc.json first (the generated model.py asks)
        self.engine: Engine | None = None
        self.text = None  # startup.TextTools: token texts for details.tokens, the vocabulary size
        self.max_sequence_length = max_sequence_length
        self.output_class = _output_class()

    def __call__(self, inputs):
        return self.handle(inputs)

    def initialize(self, properties: dict) -> None:
        from lmc.runtime.startup import TextTools

        model_dir = Path(properties.get("model_dir") or os.environ.get("MODEL_DIR") or "/opt/ml/model")
        rank, world = env_rank()
        if self.verify:
            # No `lmc runtime` checked the files before this process started: each rank checks what it
            # will read, so a tampered artifact fails to load with the file named, as it does there.
            from lmc.runtime.startup import verify_for_rank

            verify_for_rank(model_dir, rank, world)
        if world > 1:
            _init_distributed(rank, world)
        engine = self._create_engine()
        # DJL reads the last rank's answer (passive workers, which would send requests to rank 0 alone,
        # are off in serving.properties): every rank answers.
        engine.every_rank_answers = True
        engine.load(model_dir, rank, world)
        if self.max_sequence_length is None:
            self.max_sequence_length = getattr(engine, "max_sequence_length", None)
        self.text = TextTools(model_dir)
        self.engine = engine
        log.info("lmc DJL handler ready: rank %d of %d, model %s", rank, world, model_dir)

    def handle(self, inputs):
        if self.engine is None:
            self.initialize(inputs.get_properties())
        if inputs.is_empty():
            return None  # the warm-up call: loading was the point
        items = inputs.get_batches() if hasattr(inputs, "get_batches") else [inputs]
        output = self.output_class()
        parsed: list[_Item] = []
        for index, item in enumerate(items):
            try:
                parsed.append(self._parse(index, item))
            except ValueError as exc:
                _item_error(output, index, 400, str(exc))
            except Exception as exc:  # an unreadable body (not JSON)
                _item_error(output, index, 400, f"the request body is not valid JSON: {exc}")
        if len(items) == 1 and parsed and parsed[0].stream:
            output.add_property("content-type", JSONLINES)
            return output.add_stream_content(self._stream(parsed[0].request(0), parsed[0].details), None)
        requests = [item.request(n) for item in parsed for n in range(len(item.prompts))]
        pieces: dict[str, list[Piece | str]] = {item.request(0).id: [] for item in parsed if item.stream}

        def on_token(request_id: str, piece: Piece | str) -> None:
            if request_id in pieces:
                pieces[request_id].append(piece)

        try:
            results = {r.id: r for r in self.engine.generate(requests, on_token if pieces else None)} if requests else {}
        except Exception as exc:
            log.exception("generation failed")
            for item in parsed:
                _item_error(output, item.index, 424, f"model failure: {type(exc).__name__}: {exc}")
            return output
        for item in parsed:
            if item.stream:
                request = item.request(0)
                events = [*(("token", piece) for piece in pieces[request.id]), ("done", results[request.id])]
                output.add_property(f"batch_{item.index}_Content-Type", JSONLINES)
                output.add(b"".join(_jsonlines(request.prompt, events, item.details)), batch_index=item.index)
                continue
            answers = [{"generated_text": results[f"{item.index}/{n}"].text} for n in range(len(item.prompts))]
            if item.details:
                for n, answer in enumerate(answers):
                    answer["details"] = lmi_details(item.prompts[n], results[f"{item.index}/{n}"], self.text.token_text)
            output.add_as_json(answers if item.was_list else answers[0], batch_index=item.index)
        return output

    def _parse(self, index: int, item) -> _Item:
        """One batch item's body, checked as `lmc runtime` checks /invocations (ValueError: a 400)."""
        body = item.get_as_json()
        prompts, params, stream, details = parse_invocation(body, self.max_sequence_length)
        if stream and len(prompts) != 1:
            raise ValueError("stream = true takes a single string in inputs, not a list")
        check_logit_bias(params, self.text.vocab_size)
        for prompt in prompts:
            _check_length(self.engine, prompt, params.max_new_tokens, self.max_sequence_length)
        if details and not stream:  # LMI's details.tokens: each generated token's id, text and log-probability
            params = replace(params, logprobs=0)
        return _Item(index, prompts, params, isinstance(body.get("inputs"), list), stream, details)

    def _stream(self, request: GenerationRequest, details: bool) -> Iterator[bytes]:
        """The jsonlines of `request`, each as soon as it is generated: the engine runs in a thread
        (started at the first line asked for: DJL iterates the stream right after `handle` returns,
        and handles nothing else until it ends) and hands its pieces over through a queue."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        device = _cuda_device()

        def run() -> None:
            try:  # whatever happens, the stream gets its last event: DJL serves nothing else until it ends
                if device is not None:  # the current CUDA device is per thread
                    sys.modules["torch"].cuda.set_device(device)
                events.put(("done", self.engine.generate([request], lambda _id, piece: events.put(("token", piece)))[0]))
            except BaseException as exc:
                log.exception("generation failed")
                events.put(("error", exc))

        threading.Thread(target=run, name="lmc-djl-stream", daemon=True).start()

        def drain() -> Iterator[tuple[str, Any]]:
            while True:
                event = events.get()
                yield event
                if event[0] != "token":
                    return

        yield from _jsonlines(request.prompt, drain(), details)


def _jsonlines(prompt: str, events: Iterable[tuple[str, Any]], details: bool) -> Iterator[bytes]:
    """LMI jsonlines (requests.LmiLines) from ("token", Piece | str)* then ("done", GenerationResult), or
    an error line for ("error", exception)."""
    lines = LmiLines(prompt, details)
    for kind, payload in events:
        if kind == "token":
            line = lines.piece(payload)
            if line is not None:
                yield line
        elif kind == "done":
            yield lines.result(payload)
        else:
            yield jsonline({"error": f"model failure: {type(payload).__name__}: {payload}", "code": 424})


def _cuda_device() -> int | None:
    """The calling thread's CUDA device when torch has CUDA initialised, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


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
    # DJL stops a worker by ending its process: leave the group first, with the other ranks.
    from lmc.runtime.engines.tp import leave_process_group

    atexit.register(leave_process_group)
