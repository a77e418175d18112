"""The runtime's shared core: `Runtime`, the state and request plumbing every route uses.

Module layout (imports run one way, top to bottom):

  server.py                 the HTTP app: assembles the routes, serves them (uvicorn), drains
  lmi_api.py, openai_api.py the routes; they depend on this module and jobs.py, never on server.py
  core.py                   Runtime: plan limits, text tools, metrics, admission, waiting for answers
  scheduler.py              lmc's own backend: the bounded queue and worker groups (workers.py)
  jobs.py                   Job, RequestFailed, and the Backend protocol a backend implements

The runtime serves through scheduler.worker_scheduler (the plan's worker groups). vLLM plans do not come
here: they are served by vLLM's own server (vllm_server.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse

from lmc.runtime.engines.base import GenerationParams, GenerationRequest, GenerationResult
from lmc.runtime.jobs import CLIENT_CLOSED, Backend, Job, RequestFailed
from lmc.runtime.metrics import Metrics
from lmc.runtime.requests import check_logit_bias, queue_overflow
from lmc.runtime.startup import (INLINE_TOKENIZE_CHARS, TextTools, planned_output_tokens,
                                 sampling_defaults as load_sampling_defaults)

log = logging.getLogger("lmc.runtime")

# SageMaker's real-time payload limit (InvokeEndpoint: 6 MB): a body it would pass is never refused here.
DEFAULT_MAX_BODY_BYTES = 6_000_000
# Past the limit, this much more of a body is read and thrown away before the 413 (within this long), so
# a client still sending reads the answer instead of a reset; beyond it the connection is closed.
DISCARD_BYTES = 64 * 1024 * 1024
DISCARD_SECONDS = 30.0
_TIMED_OUT = ("timed out",)  # queued in a job's events at its deadline (Runtime.events)


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "code": status}, status_code=status)


class LineStream:
    """A streamed answer (LMI's jsonlines, OpenAI's SSE) as a plain ASGI response: `body`'s chunks sent as they
    come, and `body` cancelled when the client disconnects (which gives its job up: Runtime.events). What
    Starlette's StreamingResponse does, with one watcher task where it runs an anyio task group and two
    tasks per response: that was a third of the front end's time per streamed request (py-spy, 16
    concurrent 2-token requests)."""

    def __init__(self, body: AsyncIterator[bytes], media_type: str):
        self.body = body
        charset = "; charset=utf-8" if media_type.startswith("text/") else ""
        self.headers = [(b"content-type", (media_type + charset).encode())]

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        watcher.add_done_callback(lambda done: done.cancelled() or done.exception())  # read: no "never retrieved"
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            if hasattr(task, "uncancel"):  # (3.11+) the client left: this response is over, the server goes on
                task.uncancel()
        finally:
            watcher.cancel()
            await self.body.aclose()


class Runtime:
    """The state behind the routes: plan limits, text tools, scheduler, metrics, draining."""

    def __init__(self, model_dir: Path, plan: dict[str, Any], *, request_timeout_s: float,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, text_tools: TextTools | None = None,
                 sampling_defaults: dict[str, Any] | None = None,
                 group_factory: Callable[[int, Any], Any] | None = None, worker_env: dict[str, str] | None = None,
                 worker_gate=None):
        """`group_factory`, `worker_env` and `worker_gate` are for the worker groups (scheduler.worker_scheduler)."""
        self.model_dir = Path(model_dir)
        self.plan = plan
        self.model_name = str((plan.get("model") or {}).get("id") or self.model_dir.name)
        self.started_at = int(time.time())
        self.max_sequence_length = int(plan["max_sequence_length"])
        # The answer length the deployment was planned for (the spec's workload.max_output_tokens): the
        # default for chat requests without max_tokens, so they batch as the plan assumed.
        self.max_output_tokens = planned_output_tokens(self.model_dir) or self.max_sequence_length
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.text = text_tools or TextTools(self.model_dir)
        # The OpenAI routes' defaults for what a request leaves out (None: the model's generation_config.json).
        self.sampling_defaults = sampling_defaults if sampling_defaults is not None else load_sampling_defaults(self.model_dir)
        self.metrics = Metrics(int(plan["batch_size"]))
        from lmc.runtime.scheduler import worker_scheduler

        self.scheduler: Backend = worker_scheduler(self.model_dir, plan, self.metrics, request_timeout_s,
                                                   group_factory=group_factory, worker_env=worker_env,
                                                   worker_gate=worker_gate)
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop serving, once started
        self.accepting = True
        self._in_flight = 0
        self.metrics.in_flight.set_function(lambda: self._in_flight)
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.scheduler.start()

    async def stop(self) -> None:
        self.accepting = False
        await self.scheduler.stop()

    def begin_drain(self) -> None:
        """Stop accepting: /ping and new requests answer 503 from now on."""
        if self.accepting:
            log.info("draining: %d request(s) in flight", self._in_flight)
        self.accepting = False
        # A group that dies now is restarted as at any other time (workers ignore SIGTERM, so a signal
        # sent to the whole process group is not why): the requests still queued wait for it.

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def ready(self) -> bool:
        return self.accepting and self.scheduler.all_ready()

    # -- request plumbing shared by the LMI and OpenAI routes

    async def read_json(self, request: Request) -> Any:
        """The decoded body: read_body within max_body_bytes (413), then decode_json (400)."""
        return decode_json(await read_body(request, self.max_body_bytes))

    def check_accepting(self) -> None:
        if not self.accepting:
            raise RequestFailed(503, "the server is shutting down and accepts no new requests")

    def make_jobs(self, prompts: list[str], counts: list[int], params: GenerationParams, stream: bool,
                  label: str = "inputs", length_field: str = "max_new_tokens") -> list[Job]:
        """Jobs for `prompts`, after checking prompt tokens (`counts`, from count_prompts) +
        max_new_tokens fit the planned sequence length (RequestFailed 400 naming the prompt otherwise)."""
        overflow = queue_overflow(label, len(prompts), self.scheduler.capacity)
        if overflow is not None:
            raise RequestFailed(400, overflow)
        try:
            check_logit_bias(params, self.text.vocab_size)
        except ValueError as exc:
            raise RequestFailed(400, str(exc)) from None
        now = time.monotonic()
        jobs = []
        for index, (prompt, count) in enumerate(zip(prompts, counts, strict=True)):
            where = label if len(prompts) == 1 else f"{label}[{index}]"
            if count == 0:
                raise RequestFailed(400, f"{where} is empty after tokenization; give at least one token of input")
            if count + params.max_new_tokens > self.max_sequence_length:
                raise RequestFailed(400, f"{where} has {count} prompt tokens; with {length_field} = {params.max_new_tokens} "
                                         f"that is {count + params.max_new_tokens}, beyond the maximum sequence length "
                                         f"{self.max_sequence_length}")
            request = GenerationRequest(id=uuid.uuid4().hex, prompt=prompt, params=params)
            jobs.append(Job(request=request, stream=stream, prompt_tokens=count, enqueued_at=now))
        return jobs

    async def count_prompts(self, prompts: list[str], add_special_tokens: bool = True) -> list[int]:
        """Each prompt's token count, for make_jobs: count once per request. Long prompts are tokenized
        on a thread, where the tokenizer lets go of the GIL: a megabyte takes about a second, and /ping,
        streams and other requests go on meanwhile. Short ones are counted in place (cheaper than the
        hop to a thread)."""
        if sum(map(len, prompts)) <= INLINE_TOKENIZE_CHARS:
            return self.text.count_tokens(prompts, add_special_tokens)
        return await asyncio.to_thread(self.text.count_tokens, prompts, add_special_tokens)

    def admit(self, jobs: list[Job]) -> None:
        self.check_accepting()
        self.scheduler.submit(jobs)
        self._in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def results(self, jobs: list[Job], request: Request) -> list[GenerationResult]:
        """Every job's result, in order (the first failure raised). A client that disconnects first gets
        its jobs given up, so their rows stop, and RequestFailed 499: nobody reads the answer."""
        waits = [asyncio.ensure_future(self.result(job)) for job in jobs]
        answers = asyncio.gather(*waits)
        # When the client leaves first, the gather ends with the waits' CancelledError, read by nobody:
        # read it here, or asyncio logs a traceback for every hang-up.
        answers.add_done_callback(lambda future: future.cancelled() or future.exception())
        gone = asyncio.ensure_future(client_gone(request))
        answered = False
        try:
            await asyncio.wait({answers, gone}, return_when=asyncio.FIRST_COMPLETED)
            answered = answers.done()
        finally:
            gone.cancel()
            # The client left, or one job failed (the others are not waited for): each wait still running
            # gives its job up as it is cancelled.
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if not answered:
            raise RequestFailed(CLIENT_CLOSED, "the client closed the connection before the answer")
        return answers.result()

    async def result(self, job: Job) -> GenerationResult:
        """Wait for the job's result; RequestFailed 424 on a model failure or the timeout."""
        events = self.events(job)
        try:
            async for kind, payload in events:
                if kind == "done":
                    return payload
        finally:
            await events.aclose()
        raise RequestFailed(424, "no result")  # events() always ends with done or raises

    async def events(self, job: Job) -> AsyncIterator[tuple[str, Any]]:
        """("token", Piece)* then ("done", result); raises RequestFailed on failure or timeout. Leaving it,
        by any path, gives the job up (Scheduler.abandon): a row still decoding stops."""
        # One timer for the request, which queues _TIMED_OUT at its deadline, not a wait_for per event: that
        # made a task and a timer for every streamed token.
        remaining = max(0.0, job.enqueued_at + self.request_timeout_s - time.monotonic())
        timer = asyncio.get_running_loop().call_later(remaining, job.events.put_nowait, _TIMED_OUT)
        try:
            while True:
                event = await job.events.get()
                if event is _TIMED_OUT:
                    raise RequestFailed(424, f"request timed out after {self.request_timeout_s:g}s")
                if event[0] == "error":
                    raise RequestFailed(event[1], event[2])
                yield event
                if event[0] == "done":
                    return
        finally:
            timer.cancel()
            self.scheduler.abandon(job)

    def record(self, endpoint: str, status: int, started: float | None = None) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if started is not None:
            self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)




async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request body; RequestFailed 413 past `max_body_bytes`, CLIENT_CLOSED when the client leaves.

    A 413 is sent after the rest of the body is read and discarded (up to DISCARD_BYTES, within
    DISCARD_SECONDS), as nginx's lingering close does: a server that closes while the client is
    still sending makes the client's kernel see a reset, and most clients (urllib, requests) then
    report the reset, not the 413. A client that asked `Expect: 100-continue` has sent nothing yet:
    it is answered at once (it is never told to continue)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        if request.headers.get("expect", "").lower() != "100-continue":
            await _discard(request, min(int(declared), DISCARD_BYTES))
        raise RequestFailed(413, f"request body is {declared} bytes; the limit is {max_body_bytes}")
    chunks, size, more = [], 0, True
    while more:  # the ASGI messages themselves: whether more body follows decides the discard
        message = await request.receive()
        if message["type"] != "http.request":
            raise RequestFailed(CLIENT_CLOSED, "the client disconnected while sending the body")
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > max_body_bytes:
            if more:  # (after the last part, the next message is the client's disconnect: never wait for it)
                await _discard(request, DISCARD_BYTES)
            raise RequestFailed(413, f"request body exceeds the limit of {max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(data: bytes) -> Any:
    """A body decoded as JSON; RequestFailed 400 when it is not JSON, or not Unicode text."""
    try:
        body = json.loads(data)
        # Lone UTF-16 surrogates ("\ud800") are valid JSON escapes but not text: refuse them here,
        # before a tokenizer or the response encoder meets them.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestFailed(400, "the body contains a lone UTF-16 surrogate escape, which is not valid "
                                 "Unicode text") from None
    # JSONDecodeError and bad UTF-8 are ValueErrors, so are integers past Python's digit limit;
    # RecursionError: absurdly deep nesting.
    except (ValueError, RecursionError) as exc:
        raise RequestFailed(400, f"malformed JSON body: {' '.join(str(exc).split())}") from None
    return body


async def _discard(request: Request, limit: int) -> None:
    """Read and drop the body's rest, up to `limit` bytes in all and DISCARD_SECONDS (see read_body)."""
    async def drain() -> None:
        seen = 0
        while seen < limit:
            message = await request.receive()
            if message["type"] != "http.request":  # the client left
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(drain(), DISCARD_SECONDS)
    except asyncio.TimeoutError:
        pass


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the ASGI server's next message is
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


