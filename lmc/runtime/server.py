"""The HTTP front end: /ping, /invocations (the LMI schema), /metrics, and the OpenAI routes.

An ASGI app (starlette) under uvicorn. Requests become `Job`s in one bounded queue; a dispatcher
per worker group pulls batches from it when that group is ready and idle; the group's supervisor
thread hands tokens and results back to the event loop. Every failure becomes a one-line JSON error:
400 bad input, 413 body too large, 424 model failure or timeout, 503 queue full / not accepting
(and 499 in the metrics for a client that left before its answer).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lmc.runtime.batching import AsyncBatcher, BatchQueue, QueueFull
from lmc.runtime.engines.base import GenerationParams, GenerationRequest, GenerationResult, Piece
from lmc.runtime.metrics import Metrics
from lmc.runtime.requests import LmiLines, check_logit_bias, jsonline, lmi_details, parse_invocation
from lmc.runtime.startup import TextTools, planned_output_tokens, sampling_defaults as load_sampling_defaults
from lmc.runtime.workers import WorkerGroup, groups_per_instance

log = logging.getLogger("lmc.runtime")

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
# Prompts longer than this (characters, all of a request's together) are tokenized on a thread.
INLINE_TOKENIZE_CHARS = 4096
# A batch running this much longer than the request timeout means a hung group: restart it.
_HUNG_GRACE_S = 30.0
_STOP_NOW_GRACE_S = 2.0  # for handlers to send their 503 when the server stops now (see make_server)


# The status recorded in the metrics for a stream whose client went away (nginx's convention).
CLIENT_CLOSED = 499


class RequestFailed(Exception):
    """Answered as {"error": message, "code": status}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "code": status}, status_code=status)


@dataclass(eq=False)
class Job:
    """One prompt on its way through the queue, a batch and back."""

    request: GenerationRequest
    stream: bool
    prompt_tokens: int
    enqueued_at: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    finished: bool = False  # answered, failed or abandoned: later events are dropped
    batch: tuple[int, int] | None = None  # (group, batch id) while a worker group decodes it

    @property
    def id(self) -> str:
        return self.request.id


class Scheduler:
    """Jobs in, batches out to worker groups, events back to jobs. Lives on the event loop; the
    `on_*` methods are the `GroupEvents` called from supervisor threads and hop onto the loop."""

    def __init__(self, plan: dict[str, Any], metrics: Metrics, group_factory: Callable[[int, Any], Any],
                 request_timeout_s: float):
        self.plan = plan
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.batcher: AsyncBatcher[Job] = AsyncBatcher(BatchQueue(
            int(plan["job_queue_size"]), int(plan["batch_size"]), int(plan["max_batch_delay_ms"]) / 1000.0))
        self.group_count = groups_per_instance(plan)
        self.groups = [group_factory(index, self) for index in range(self.group_count)]
        self._ready = [asyncio.Event() for _ in self.groups]
        self._batches: dict[int, dict[str, Job]] = {}
        self._batch_done: dict[int, asyncio.Future] = {}
        self._batch_ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early: list[tuple] = []  # events that arrived before the event loop ran
        self._loop_lock = threading.Lock()
        self._stopping = False
        self.fatal: Exception | None = None  # a group that cannot load the model: the server stops
        self.on_fatal_hook: Callable[[], None] | None = None
        # Read when /metrics is scraped, so they can never be stale.
        metrics.queue_depth.set_function(lambda: len(self.batcher.queue))
        metrics.groups_ready.set_function(lambda: sum(event.is_set() for event in self._ready))

    # -- lifecycle

    def start_groups(self) -> None:
        """Spawn the worker processes; may run before the event loop (to overlap with start-up work)."""
        for group in self.groups:
            group.start()

    def start(self) -> None:
        with self._loop_lock:
            self._loop = asyncio.get_running_loop()
            early, self._early = self._early, []
        for fn, args in early:
            self._loop.call_soon(fn, *args)
        self.start_groups()
        for index in range(len(self.groups)):
            self._tasks.append(asyncio.create_task(self._dispatch(index), name=f"lmc-dispatch-{index}"))

    def stop_groups(self) -> None:
        """Stop the workers without an event loop (start-up failed before serving)."""
        self._stopping = True
        for group in self.groups:
            group.stop()

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for job in self.batcher.queue.drain():
            self._fail(job, 503, "the server is shutting down")
        await asyncio.gather(*(asyncio.to_thread(group.stop) for group in self.groups))

    def all_ready(self) -> bool:
        return all(event.is_set() for event in self._ready)

    @property
    def capacity(self) -> int:
        """The most jobs admitted and not yet taken (a request's prompts x n must fit)."""
        return self.batcher.queue.capacity

    # -- admission

    def submit(self, jobs: list[Job]) -> None:
        """Queue all of `jobs` or raise RequestFailed(503) at once when the queue is full."""
        try:
            self.batcher.submit(jobs)
        except QueueFull as exc:
            raise RequestFailed(503, str(exc)) from None

    def abandon(self, job: Job) -> None:
        """The job's answer is no longer wanted (or has been given): out of the queue, and, when a group
        is decoding it, that group stops its row (a client that left must not hold a batch slot)."""
        job.finished = True
        self.batcher.remove(job)
        if job.batch is not None:
            group, batch_id = job.batch
            job.batch = None
            self.groups[group].cancel(batch_id, job.id)

    # -- dispatch: one coroutine per group

    async def _dispatch(self, index: int) -> None:
        group = self.groups[index]
        while True:
            await self._ready[index].wait()
            jobs = await self.batcher.next_batch()
            jobs = [job for job in jobs if not job.finished]
            if not jobs:
                continue
            if not self._ready[index].is_set():  # went down while we waited for work
                self.batcher.requeue(jobs)
                await asyncio.sleep(0)
                continue
            batch_id = next(self._batch_ids)
            self._batches[batch_id] = {job.id: job for job in jobs}
            done = self._loop.create_future()
            self._batch_done[batch_id] = done
            try:
                group.submit(batch_id, [job.request for job in jobs], [job.id for job in jobs if job.stream])
            except RuntimeError:  # it went down; its on_down is still on its way to this loop
                del self._batches[batch_id], self._batch_done[batch_id]
                self.batcher.requeue(jobs)
                self._set_ready(index, False)  # wait for on_ready instead of spinning on the same batch
                await asyncio.sleep(0)
                continue
            for job in jobs:
                job.batch = (index, batch_id)
            self.metrics.batch_size.observe(len(jobs))
            try:
                await asyncio.wait_for(asyncio.shield(done), self.request_timeout_s + _HUNG_GRACE_S)
            except asyncio.TimeoutError:
                group.kill(f"batch {batch_id} ran {self.request_timeout_s + _HUNG_GRACE_S:g}s")
                await done  # the supervisor fails it once the processes are gone

    # -- events from supervisor threads

    def _call(self, fn, *args) -> None:
        with self._loop_lock:
            if self._loop is None:
                self._early.append((fn, args))
                return
        if not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed during shutdown
                pass

    def on_ready(self, group: int) -> None:
        self._call(self._set_ready, group, True)

    def on_down(self, group: int, reason: str) -> None:
        self._call(self._set_ready, group, False)

    def on_restart(self, group: int) -> None:
        self.metrics.restarts.inc()  # not on_down: a fatal load failure or a drain restarts nothing

    def on_fatal(self, group: int, error: Exception) -> None:
        self._call(self._fatal, error)

    def on_token(self, group: int, batch_id: int, request_id: str, piece: Piece) -> None:
        self._call(self._token, batch_id, request_id, piece)

    def on_result(self, group: int, batch_id: int, results: list) -> None:
        self._call(self._result, batch_id, results)

    def on_failure(self, group: int, batch_id: int, message: str) -> None:
        self._call(self._failure, batch_id, message)

    def _fatal(self, error: Exception) -> None:
        if self.fatal is None:
            self.fatal = error
            if self.on_fatal_hook is not None:
                self.on_fatal_hook()

    def _set_ready(self, group: int, ready: bool) -> None:
        (self._ready[group].set if ready else self._ready[group].clear)()

    def _token(self, batch_id: int, request_id: str, piece: Piece) -> None:
        job = self._batches.get(batch_id, {}).get(request_id)
        if job is None or job.finished:
            return
        if job.first_token_at is None:
            job.first_token_at = time.monotonic()
            self.metrics.ttft.observe(job.first_token_at - job.enqueued_at)
        if job.stream:
            job.events.put_nowait(("token", piece))

    def _result(self, batch_id: int, results: list[GenerationResult]) -> None:
        jobs = self._batches.pop(batch_id, {})
        for result in results:
            job = jobs.pop(result.id, None)
            if job is None:
                continue
            job.batch = None
            self.metrics.generated_tokens.inc(result.generated_tokens)
            self.metrics.prompt_tokens.inc(result.prompt_tokens)
            if job.first_token_at is None and not job.finished:  # (a given-up job never had a first token)
                self.metrics.ttft.observe(time.monotonic() - job.enqueued_at)
            if not job.finished:
                job.events.put_nowait(("done", result))
        for job in jobs.values():  # an engine that dropped a request must not leave it hanging
            self._fail(job, 424, "the engine returned no result for this request")
        self._finish_batch(batch_id)

    def _failure(self, batch_id: int, message: str) -> None:
        for job in self._batches.pop(batch_id, {}).values():
            job.batch = None
            self._fail(job, 424, message)
        self._finish_batch(batch_id)

    def _finish_batch(self, batch_id: int) -> None:
        done = self._batch_done.pop(batch_id, None)
        if done is not None and not done.done():
            done.set_result(None)

    def fail_all(self, status: int, message: str) -> None:
        """Fail every job queued or being generated (the server stops now)."""
        for job in self.batcher.queue.drain():
            self._fail(job, status, message)
        for jobs in self._batches.values():
            for job in jobs.values():
                self._fail(job, status, message)

    def _fail(self, job: Job, status: int, message: str) -> None:
        if not job.finished:
            job.events.put_nowait(("error", status, message))


class Runtime:
    """The state behind the routes: plan limits, text tools, scheduler, metrics, draining."""

    def __init__(self, model_dir: Path, plan: dict[str, Any], *, request_timeout_s: float,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, group_factory: Callable[[int, Any], Any] | None = None,
                 worker_env: dict[str, str] | None = None, text_tools: TextTools | None = None,
                 worker_gate=None, sampling_defaults: dict[str, Any] | None = None):
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
        if group_factory is None and plan.get("engine") != "vllm":
            def group_factory(index: int, events) -> WorkerGroup:
                return WorkerGroup(self.model_dir, plan, index, events, extra_env=worker_env, gate=worker_gate)
        if plan.get("engine") == "vllm" and group_factory is None:  # vLLM's own scheduler, in process
            from lmc.runtime.vllm_backend import VllmScheduler

            self.scheduler = VllmScheduler(self.model_dir, plan, self.metrics, self.text, request_timeout_s,
                                           gate=worker_gate)
        else:
            self.scheduler = Scheduler(plan, self.metrics, group_factory, request_timeout_s)
        self.accepting = True
        self._in_flight = 0
        self.metrics.in_flight.set_function(lambda: self._in_flight)
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle

    async def start(self) -> None:
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
        """The decoded body; RequestFailed 413 past max_body_bytes, 400 when it is not JSON."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise RequestFailed(413, f"request body is {declared} bytes; the limit is {self.max_body_bytes}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise RequestFailed(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise RequestFailed(CLIENT_CLOSED, "the client disconnected while sending the body") from None
        try:
            body = json.loads(b"".join(chunks))
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

    def check_accepting(self) -> None:
        if not self.accepting:
            raise RequestFailed(503, "the server is shutting down and accepts no new requests")

    def make_jobs(self, prompts: list[str], counts: list[int], params: GenerationParams, stream: bool,
                  label: str = "inputs", length_field: str = "max_new_tokens") -> list[Job]:
        """Jobs for `prompts`, after checking prompt tokens (`counts`, from count_prompts) +
        max_new_tokens fit the planned sequence length (RequestFailed 400 naming the prompt otherwise)."""
        capacity = self.scheduler.capacity
        if len(prompts) > capacity:
            raise RequestFailed(400, f"{label} has {len(prompts)} prompts; the request queue holds {capacity}: "
                                     f"send at most {capacity} per request")
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
        gone = asyncio.ensure_future(_client_gone(request))
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
        deadline = job.enqueued_at + self.request_timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    event = await asyncio.wait_for(job.events.get(), max(0.0, remaining))
                except asyncio.TimeoutError:
                    raise RequestFailed(424, f"request timed out after {self.request_timeout_s:g}s") from None
                if event[0] == "error":
                    raise RequestFailed(event[1], event[2])
                yield event
                if event[0] == "done":
                    return
        finally:
            self.scheduler.abandon(job)

    def record(self, endpoint: str, status: int, started: float | None = None) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if started is not None:
            self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)


# ---------------------------------------------------------------- routes

async def ping(request: Request) -> Response:
    runtime: Runtime = request.app.state.runtime
    if runtime.ready():
        return JSONResponse({"status": "healthy"})
    reason = "shutting down" if not runtime.accepting else "loading or restarting worker groups"
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


async def metrics(request: Request) -> Response:
    runtime: Runtime = request.app.state.runtime
    return Response(runtime.metrics.render(), media_type=runtime.metrics.content_type)


async def invocations(request: Request) -> Response:
    runtime: Runtime = request.app.state.runtime
    started = time.monotonic()
    try:
        runtime.check_accepting()
        body = await runtime.read_json(request)
        try:
            prompts, params, stream, details = parse_invocation(body, runtime.max_sequence_length)
        except ValueError as exc:
            raise RequestFailed(400, str(exc)) from None
        if stream and len(prompts) != 1:
            raise RequestFailed(400, "stream = true takes a single string in inputs, not a list")
        if details and not stream:  # LMI's details.tokens: each generated token's id, text and log-probability
            params = replace(params, logprobs=0)
        jobs = runtime.make_jobs(prompts, await runtime.count_prompts(prompts, params.add_special_tokens), params,
                                 stream)
        runtime.admit(jobs)
    except RequestFailed as exc:
        runtime.record("invocations", exc.status)
        return error_response(exc.status, exc.message)
    if stream:
        return StreamingResponse(_jsonlines(runtime, jobs[0], details, started), media_type="application/jsonlines")
    try:
        results = await runtime.results(jobs, request)
    except RequestFailed as exc:
        for job in jobs:
            runtime.scheduler.abandon(job)
        runtime.record("invocations", exc.status, started)
        return error_response(exc.status, exc.message)
    finally:
        runtime.release()
    answers = [{"generated_text": result.text} for result in results]
    if details:
        for answer, job, result in zip(answers, jobs, results):
            answer["details"] = lmi_details(job.request.prompt, result, runtime.text.token_text)
    runtime.record("invocations", 200, started)
    return JSONResponse(answers[0] if isinstance(body["inputs"], str) else answers)


async def _jsonlines(runtime: Runtime, job: Job, details: bool, started: float) -> AsyncIterator[bytes]:
    """LMI streaming (requests.LmiLines), or an error line."""
    status = 200
    lines = LmiLines(job.request.prompt, details)
    try:
        async for kind, payload in runtime.events(job):
            line = lines.piece(payload) if kind == "token" else lines.result(payload)
            if line is not None:
                yield line
    except RequestFailed as exc:
        status = exc.status
        yield jsonline({"error": exc.message, "code": exc.status})
    except (asyncio.CancelledError, GeneratorExit):
        status = CLIENT_CLOSED
        raise
    finally:
        runtime.release()
        runtime.record("invocations", status, started)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the ASGI server's next message is
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _not_found(request: Request, exc: HTTPException) -> Response:
    response = error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path)
    runtime: Runtime = request.app.state.runtime
    runtime.record(request.url.path.strip("/").replace("/", "_") or "root", 500)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def create_app(runtime: Runtime) -> Starlette:
    from contextlib import asynccontextmanager

    from lmc.runtime.openai_api import openai_routes

    @asynccontextmanager
    async def lifespan(app):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    routes = [
        Route("/ping", ping, methods=["GET"]),
        Route("/health", ping, methods=["GET"]),  # what vLLM and TGI users probe (Kubernetes), same answer
        Route("/invocations", invocations, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai_routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _not_found, Exception: _unexpected})
    app.state.runtime = runtime
    return app


# ---------------------------------------------------------------- serving

def serve(runtime: Runtime, host: str, port: int, drain_timeout_s: float | None = None) -> bool:
    """Run the app until SIGTERM/SIGINT: then answer 503 to new work, let in-flight requests finish
    (up to `drain_timeout_s`), stop the worker groups and return False. A second SIGINT during the drain
    cuts it short (the requests still in flight are answered 503): then True."""
    server = make_server(runtime, host, port, drain_timeout_s)
    server.run()
    return server.cut_short


def make_server(runtime: Runtime, host: str, port: int, drain_timeout_s: float | None = None):
    """The uvicorn server for `runtime`, draining on SIGTERM/SIGINT (signals are only captured when
    it runs in the main thread; tests run it in a thread and set `should_exit`)."""
    import uvicorn

    drain_timeout_s = runtime.request_timeout_s if drain_timeout_s is None else drain_timeout_s

    class DrainingServer(uvicorn.Server):
        draining = False
        cut_short = False  # by a second Ctrl-C: serve() says so
        stopping_now = False

        def handle_exit(self, sig: int, frame) -> None:
            # Not uvicorn's: it closes the socket at once and re-raises the signal at exit (so the
            # process would not exit 0). We keep answering 503 while in-flight requests finish.
            loop = runtime.scheduler._loop
            if self.draining:
                # A second Ctrl-C stops now, as uvicorn's does. A repeated SIGTERM does not: container
                # runtimes resend it, and their SIGKILL ends a drain that takes too long.
                if sig == signal.SIGINT and not self.cut_short:
                    self.cut_short = True
                    if loop is None:
                        self.should_exit = True
                    else:
                        loop.call_soon_threadsafe(lambda: loop.create_task(self._stop_now("second interrupt")))
                return
            self.draining = True
            if loop is None:
                self.should_exit = True
                return
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

        async def _drain(self) -> None:
            runtime.begin_drain()
            if not await runtime.wait_idle(drain_timeout_s):
                await self._stop_now(f"drain timed out after {drain_timeout_s:g}s")
            self.should_exit = True

        async def _stop_now(self, why: str) -> None:
            """Answer every request still queued or generating 503 (a stream: its error event), let the
            handlers send that, then stop: no request is cut off without a word, and no handler dies
            cancelled, with a traceback in the log. (uvicorn's force_exit would also skip the lifespan
            shutdown that stops the worker groups.)"""
            if self.stopping_now:
                return
            self.stopping_now = True
            log.warning("%s: stopping now; %d request(s) in flight are answered 503", why, runtime._in_flight)
            runtime.scheduler.fail_all(503, f"the server stopped ({why}) before this request finished")
            await runtime.wait_idle(_STOP_NOW_GRACE_S)
            self.should_exit = True

    config = uvicorn.Config(create_app(runtime), host=host, port=port, lifespan="on", access_log=False,
                            log_level="info", timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = DrainingServer(config)

    def stop_serving() -> None:  # a group cannot load the model: nothing will ever be served
        runtime.accepting = False
        server.should_exit = True

    runtime.scheduler.on_fatal_hook = stop_serving
    return server
