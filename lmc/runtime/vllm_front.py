"""What lmc adds in front of vLLM's OpenAI server, as one ASGI middleware (vLLM's `--middleware` hook).

vLLM's server answers every route itself (OpenAI completions, chat, responses, models, tokenize, tool
calls, structured output, /health, /metrics, and SageMaker's /ping and /invocations for OpenAI-shaped
bodies). `LmcFront` sits outermost and adds only what lmc's contract has and vLLM's server lacks:

- **LMI on /invocations**: a body with `inputs` (`{"inputs", "parameters", "stream"}`, validated by
  lmc.runtime.requests as for every lmc engine) becomes one /v1/completions request to vLLM's own
  route, and its answer LMI's: `generated_text`, `details` (finish reason, token count, each token's id,
  text and log-probability), a list for a list of inputs, and LMI's jsonlines for `stream: true`. Any
  other body goes to vLLM's /invocations untouched.
- **The body limit**: 413 past `max_body_bytes` (6 MB, SageMaker's payload limit), before vLLM reads it.
- **Retry-After** on every 503 (vLLM's admission answers 503 past `max_num_queued_reqs`; lmc sets that
  bound from the plan's TTFT goal, see lmc.planner.vllm.admission).
- **The drain**: on SIGTERM or Ctrl-C (to this process or its whole group: vLLM's engine processes are
  in a group of their own, lmc.runtime.process_group), /ping and new requests get 503 at once while the
  requests in flight are answered; then the HTTP server stops, vLLM's engine client shuts its engine
  down, and the process exits 0. A second Ctrl-C stops now: what is in flight is answered 503 (a
  stream: its error event or line), and the runtime exits 130.
- **A lost node** (across instances): 503 everywhere, then the server stops (the runtime exits 1).
- **lmc's series on /metrics** beside vLLM's: `lmc_info` (lmc version, plan sha256), requests in
  flight, refusals by reason, and with LoRA adapters the requests that selected each (an `adapter` label).
- **LMI's adapter selection** on /invocations: `"adapters": "<name>"` in the body, or SageMaker's adapter
  headers, becomes the `model` of vLLM's request (lmi_adapter).

The middleware finds its settings (`FrontState`) on vLLM's parsed arguments (`app.state.args.lmc_front`),
which vLLM keeps on the app.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lmc.runtime.core import decode_json, error_response, read_body
from lmc.runtime.engines.base import GenerationParams, GenerationResult, Piece
from lmc.runtime.jobs import CLIENT_CLOSED, RequestFailed
from lmc.runtime.openai_api import openai_error
from lmc.runtime.requests import LmiLines, jsonline, lmi_details, parse_invocation, queue_overflow

log = logging.getLogger("lmc.runtime")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# POST routes that are not generation: not counted in flight, not refused while draining.
_NOT_WORK = frozenset({"/ping", "/tokenize", "/detokenize"})
_HEALTH = frozenset({"/ping", "/health"})
# vLLM's finish_reason -> lmc's (lmi_details maps lmc's to LMI's names).
_FINISH = {"length": "length", "abort": "cancelled"}
_STOP_NOW_GRACE_S = 2.0  # for the handlers cut off by a stop-now to send their 503


@dataclass
class FrontState:
    """LmcFront's settings and counters, one per server."""

    model_name: str
    max_sequence_length: int
    max_body_bytes: int
    retry_after_s: int
    drain_timeout_s: float
    eos_ids: frozenset[int]
    lmc_version: str = ""
    plan_sha256: str = ""
    text: Any = None  # lmc.runtime.startup.TextTools: token texts for LMI's details
    adapters: tuple[str, ...] = ()  # the LoRA adapters served (plan.lora), selectable by name
    max_queued: int = 0  # vLLM's max_num_queued_reqs: an LMI request of more inputs is never admitted (0: unchecked)
    adapter_requests: dict[str, int] = field(default_factory=dict)  # requests that selected each adapter
    in_flight: int = 0
    refusing: str | None = None  # why everything is refused (shutting down, a lost node, a dead engine)
    refusing_as: str = ""  # its label in lmc_requests_refused_total
    fatal: BaseException | None = None  # why the server stopped, when it must exit non-zero
    refused: dict[str, int] = field(default_factory=dict)
    app: Any = None  # vLLM's app, once its lifespan starts
    cut_short: bool = False  # a second Ctrl-C stopped the drain: the runtime exits 130
    _idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is in flight
    _requests: set = field(default_factory=set)  # the tasks answering requests in flight
    _stopping_now: str | None = None  # why the requests in flight are being cut off

    def __post_init__(self) -> None:
        self._idle.set()

    # -- counters

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()
        self._requests.add(asyncio.current_task())

    def leave(self) -> None:
        self.in_flight -= 1
        self._requests.discard(asyncio.current_task())
        if self.in_flight == 0:
            self._idle.set()

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def selected(self, model: object) -> None:
        """Count a request that names one of the adapters (lmc_adapter_requests_total)."""
        if model in self.adapters:
            self.adapter_requests[model] = self.adapter_requests.get(model, 0) + 1

    # -- lifecycle

    def started(self, app) -> None:
        """vLLM's server starts serving (its signal handlers are installed by now): lmc's replace them, so
        SIGTERM and Ctrl-C drain first. (vLLM's engine processes run in a process group of their own,
        lmc.runtime.process_group: a signal to the whole group reaches this process only.)"""
        self.app = app
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.on_signal, signum)
        if self.fatal is not None:  # a node was lost while the engine started
            loop.call_soon(self._should_exit)

    def on_signal(self, signum: int) -> None:
        """The first SIGTERM or SIGINT drains; a second SIGINT (Ctrl-C twice) stops now, as lmc's own front
        end and uvicorn do. A repeated SIGTERM does not: container runtimes resend it, and their SIGKILL
        ends a drain that takes too long."""
        if self.refusing is None:
            self.begin_drain(signal.Signals(signum).name)
        elif signum == signal.SIGINT and self.refusing_as == "shutting_down" and not self.cut_short:
            self.cut_short = True
            self.stop_now("second interrupt")

    def begin_drain(self, why: str = "SIGTERM") -> None:
        if self.refusing is not None:
            return
        log.info("%s: draining %d request(s) in flight (at most %gs), refusing new ones", why, self.in_flight,
                 self.drain_timeout_s)
        self.refusing, self.refusing_as = "the server is shutting down", "shutting_down"
        asyncio.get_running_loop().create_task(self._drain(), name="lmc-drain")

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout_s)
        except asyncio.TimeoutError:
            self.stop_now(f"drain timed out after {self.drain_timeout_s:g}s")
            return
        self._should_exit()  # the HTTP server stops; vLLM's engine client then shuts the engine down

    def stop_now(self, why: str) -> None:
        """Answer every request in flight 503 (a stream: an error event or line; vLLM aborts each one's
        generation as its handler is cancelled), then stop the server. Call on the event loop."""
        if self._stopping_now is not None:
            return
        self._stopping_now = why
        log.warning("%s: stopping now; %d request(s) in flight are answered 503", why, self.in_flight)
        for task in list(self._requests):
            task.cancel()
        asyncio.get_running_loop().create_task(self._exit_when_answered(), name="lmc-stop-now")

    @property
    def cut_off_message(self) -> str:
        return f"the server stopped ({self._stopping_now}) before this request finished"

    async def _exit_when_answered(self) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), _STOP_NOW_GRACE_S)
        except asyncio.TimeoutError:
            pass
        self._should_exit()

    def stop(self, why: str, label: str, error: BaseException, grace_s: float) -> None:
        """Refuse everything now (`label` in the refusal counts) and stop the server after `grace_s` (probes
        and clients see why); the runtime then exits with `error`. Call on the event loop."""
        if self.fatal is not None:
            return
        self.refusing, self.refusing_as, self.fatal = why, label, error
        log.error("%s", why)
        asyncio.get_running_loop().call_later(grace_s, self._should_exit)

    def _should_exit(self) -> None:
        server = getattr(getattr(self.app, "state", None), "server", None)
        if server is not None:
            server.should_exit = True


class LmcFront:
    """The ASGI middleware (see the module docstring)."""

    def __init__(self, app):
        self.app = app
        self.state: FrontState | None | bool = None  # False: not started by lmc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.state is None:
            self.state = getattr(getattr(scope["app"].state, "args", None), "lmc_front", None) or False
        if self.state is False:  # vLLM's server with lmc's middleware but not started by lmc: nothing to add
            return await self.app(scope, receive, send)
        state = self.state
        if scope["type"] == "lifespan":
            if state.app is None:
                state.started(scope["app"])
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in _HEALTH:
            if state.refusing is not None:
                return await _send(send, JSONResponse({"status": "unhealthy", "reason": state.refusing}, 503))
            return await self.app(scope, receive, send)
        if scope["method"] != "POST" or path in _NOT_WORK:
            return await self.app(scope, receive, send)
        lmi = path == "/invocations"
        if state.refusing is not None:
            state.refuse(state.refusing_as)
            return await _send(send, _error(503, f"{state.refusing}; retry later", lmi, state.retry_after_s))
        state.enter()
        reply = _Progress(_with_retry_after(send, state))
        try:
            await self._work(scope, receive, reply.send, lmi)
        except asyncio.CancelledError:
            if state._stopping_now is None:  # the client left, or the server is torn down
                raise
            await reply.cut_off(state.cut_off_message, lmi, state.retry_after_s)
        finally:
            state.leave()

    async def _work(self, scope: Scope, receive: Receive, send: Send, lmi: bool) -> None:
        """One request of generation work: its body checked (and, LMI's, translated), then vLLM's answer."""
        state = self.state
        declared = Request(scope).headers.get("content-length")
        # Read here (core.read_body: the limit, a 413 after a lingering close) to look at an LMI body, to
        # count one of unknown length, or to refuse one declared too large; otherwise vLLM reads it.
        # With adapters served, every body is read too: the `model` it names feeds lmc_adapter_requests_total.
        if (lmi or declared is None or not declared.isdigit() or int(declared) > state.max_body_bytes
                or state.adapters):
            try:
                body = await read_body(Request(scope, receive), state.max_body_bytes)
            except RequestFailed as exc:
                if exc.status == CLIENT_CLOSED:
                    return
                state.refuse("body_too_large")
                return await _send(send, _error(exc.status, exc.message, lmi))
            if lmi and await self._lmi(scope, body, receive, send):
                return
            if state.adapters:
                state.selected(_named_model(body))
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _lmi(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> bool:
        """Answer an LMI-shaped /invocations body through vLLM's /v1/completions; False: not LMI's shape."""
        state = self.state
        try:
            decoded = decode_json(body)
        except RequestFailed as exc:
            await _send(send, _error(exc.status, exc.message, True))
            return True
        if not (isinstance(decoded, dict) and "inputs" in decoded):
            return False  # OpenAI's shapes: vLLM's SageMaker route picks the handler
        try:
            adapter, decoded = lmi_adapter(decoded, Request(scope).headers, state.adapters)
            prompts, params, stream, details = parse_invocation(decoded, state.max_sequence_length)
            if stream and len(prompts) != 1:
                raise ValueError("stream = true takes a single string in inputs, not a list")
            overflow = queue_overflow("inputs", len(prompts), state.max_queued) if state.max_queued else None
            if overflow is not None:  # vLLM's 503 would say "retry", in vain
                raise ValueError(overflow)
        except ValueError as exc:
            await _send(send, _error(400, str(exc), True))
            return True
        state.selected(adapter)
        request = completion_request(prompts if isinstance(decoded["inputs"], list) else prompts[0], params,
                                     stream, details, adapter or state.model_name)
        data = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-type")]
        inner = dict(scope, path="/v1/completions", raw_path=b"/v1/completions",
                     headers=headers + [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(data)).encode())])
        if stream:
            lines = LmiStream(send, prompts[0], params, details, state)
            await self.app(inner, _replay(data, receive), lines.send)
            return True
        reply = _Collected()
        await self.app(inner, _replay(data, receive), reply.send)
        if reply.status != 200:  # vLLM's refusal in LMI's shape (a 503 gets its Retry-After from `send`)
            await _send(send, _error(reply.status, _vllm_error(reply.body), True))
            return True
        answers = lmi_answers(json.loads(reply.body), prompts, params, details, state)
        await _send(send, JSONResponse(answers if isinstance(decoded["inputs"], list) else answers[0]))
        return True


# ---------------------------------------------------------------- LMI <-> OpenAI completions (pure)

ADAPTER_HEADER = "x-amzn-sagemaker-adapter-identifier"  # SageMaker inference components' adapter
CUSTOM_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"  # DJL Serving: "adapter=<name>"


def lmi_adapter(body: dict[str, Any], headers: Any, known: tuple[str, ...]) -> tuple[str | None, dict[str, Any]]:
    """The adapter an LMI request selects, and the body without LMI's `adapters` key. As DJL Serving reads it:
    `"adapters": "<name>"` (or one name per input, "" for the base model) in the body, else the SageMaker
    headers X-Amzn-SageMaker-Adapter-Identifier or X-Amzn-SageMaker-Custom-Attributes `adapter=<name>`.
    vLLM runs one request's prompts with one model, so the inputs of a request share their adapter."""
    names: list[str] = []
    if "adapters" in body:
        value = body["adapters"]
        body = {key: item for key, item in body.items() if key != "adapters"}
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(item, str) for item in values):
            raise ValueError("adapters must be an adapter's name or a list of names (one per input)")
        names = sorted(set(values))
        if len(names) > 1:
            raise ValueError(f"adapters: one adapter per request (got {', '.join(map(repr, names))}); send the "
                             "inputs of each adapter in their own request")
    elif headers.get(ADAPTER_HEADER):
        names = [headers[ADAPTER_HEADER].strip()]
    elif headers.get(CUSTOM_ATTRIBUTES):
        pairs = (part.strip().split("=", 1) for part in re.split(r"[;,]", headers[CUSTOM_ATTRIBUTES]))
        names = [value.strip() for key, *rest in pairs if key.strip() == "adapter" for value in rest]
    name = names[0] if names else ""
    if name and name not in known:
        served = ", ".join(known) if known else "none"
        raise ValueError(f"unknown adapter {name!r}; this model serves: {served}")
    return name or None, body


def _named_model(body: bytes) -> object:
    """The `model` an OpenAI body names (None if it is not a JSON object)."""
    try:
        decoded = json.loads(body)
    except ValueError:
        return None
    return decoded.get("model") if isinstance(decoded, dict) else None

def completion_request(prompt: str | list[str], params: GenerationParams, stream: bool, details: bool,
                       model: str) -> dict[str, Any]:
    """The /v1/completions body for an LMI request (its parameters already validated). Every sampling
    value is sent, so the model's generation_config.json defaults (vLLM's, for OpenAI requests) do not
    apply: LMI's defaults are greedy. Token ids and log-probabilities are asked for when the answer
    shows them (details, and every streamed line)."""
    greedy = not params.do_sample
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": params.max_new_tokens, "min_tokens": params.min_new_tokens,
        "temperature": 0.0 if greedy else params.temperature, "top_p": 1.0 if greedy else params.top_p,
        "top_k": 0 if greedy else params.top_k, "repetition_penalty": params.repetition_penalty,
        "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
        "ignore_eos": params.ignore_eos, "add_special_tokens": params.add_special_tokens, "stream": stream,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
    if details or stream:
        body["logprobs"] = 0
        body["return_tokens_as_token_ids"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def finish_reason(choice: dict[str, Any]) -> str:
    """lmc's finish reason for one of vLLM's choices: "stop" with a stop string is a stop sequence,
    otherwise the end-of-sequence token."""
    reason = choice.get("finish_reason")
    if reason == "stop":
        return "stop" if isinstance(choice.get("stop_reason"), str) else "eos"
    return _FINISH.get(reason, reason or "length")


def token_logprobs(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    """(ids, log-probabilities) of a choice's tokens ("token_id:N", as return_tokens_as_token_ids writes
    them); -inf as -9999.0, as vLLM's server writes it."""
    logprobs = choice.get("logprobs") or {}
    ids = [int(str(token).rsplit(":", 1)[1]) for token in logprobs.get("tokens") or []]
    values = [-9999.0 if value is None else float(value) for value in logprobs.get("token_logprobs") or []]
    return ids, values


def _result(prompt: str, text: str, params: GenerationParams, finish: str, ids: list[int], values: list[float],
            eos: frozenset[int], prompt_tokens: int = 0) -> GenerationResult:
    if finish == "eos" and ids and ids[-1] in eos:  # the EOS is not a generated token (as the other engines count)
        ids, values = ids[:-1], values[:len(ids) - 1]
    return GenerationResult(id="", text=prompt + text if params.return_full_text else text,
                            prompt_tokens=prompt_tokens, generated_tokens=len(ids), finish_reason=finish,
                            token_ids=ids, logprobs=[(value, ()) for value in values])


def lmi_answers(reply: dict[str, Any], prompts: list[str], params: GenerationParams, details: bool,
                state: FrontState) -> list[dict[str, Any]]:
    """LMI's answers (one per prompt) from vLLM's completion response."""
    answers = []
    for prompt, choice in zip(prompts, sorted(reply["choices"], key=lambda c: c["index"])):
        ids, values = token_logprobs(choice)
        result = _result(prompt, choice["text"], params, finish_reason(choice), ids, values, state.eos_ids)
        answer: dict[str, Any] = {"generated_text": result.text}
        if details:
            answer["details"] = lmi_details(prompt, result, state.text.token_text if state.text else None)
        answers.append(answer)
    return answers


class LmiStream:
    """vLLM's server-sent events for one streamed completion in, LMI's jsonlines out
    (lmc.runtime.requests.LmiLines: a line per chunk, the last with generated_text and details)."""

    def __init__(self, send: Send, prompt: str, params: GenerationParams, details: bool, state: FrontState):
        self._send, self.prompt, self.params, self.state = send, prompt, params, state
        self.lines = LmiLines(prompt, details)
        self.status = 0
        self._buffer = b""
        self._error = b""
        self.text = ""
        self.ids: list[int] = []
        self.values: list[float] = []
        self.finish: str | None = None
        self.ended = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.status == 200:
                await self._send({"type": "http.response.start", "status": 200,
                                  "headers": [(b"content-type", b"application/jsonlines")]})
            return
        if message["type"] != "http.response.body":
            return await self._send(message)
        more = message.get("more_body", False)
        if self.status != 200:  # refused before streaming: one LMI error object
            self._error += message.get("body", b"")
            if not more:  # (a 503 gets its Retry-After from the middleware's send)
                await _send(self._send, _error(self.status, _vllm_error(self._error), True))
            return
        self._buffer += message.get("body", b"")
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            line = self._event(event)
            if line:
                await self._send({"type": "http.response.body", "body": line, "more_body": True})
        if not more:
            await self._send({"type": "http.response.body", "body": self._end(), "more_body": False})

    def _event(self, event: bytes) -> bytes | None:
        data = event.decode("utf-8").removeprefix("data: ").strip()
        if not data or data == "[DONE]":
            return None
        chunk = json.loads(data)
        if "error" in chunk:
            self.ended = True
            error = chunk["error"]
            return jsonline({"error": _message(error), "code": int(error.get("code") or 500)
                             if isinstance(error, dict) else 500})
        line = None
        for choice in chunk.get("choices") or []:
            ids, values = token_logprobs(choice)
            self.text += choice.get("text") or ""
            self.ids += ids
            self.values += values
            if choice.get("finish_reason") is not None:
                self.finish = finish_reason(choice)
            if choice.get("text") or ids or self.finish:
                line = self.lines.piece(Piece(choice.get("text") or "", ids[-1] if ids else None,
                                              values[-1] if values else None, last=self.finish is not None))
        return line

    def _end(self) -> bytes:
        if self.ended:
            return b""
        if self.finish is None:  # the stream ended without a finish: the engine stopped it
            return jsonline({"error": "the answer ended early (the engine stopped)", "code": 500})
        return self.lines.result(_result(self.prompt, self.text, self.params, self.finish, self.ids, self.values,
                                         self.state.eos_ids))


# ---------------------------------------------------------------- ASGI helpers

class _Progress:
    """A request's `send`, noting how far its answer got, so that a request cut off by a stop-now still
    ends with a word: a 503 in the route's shape before its answer started, else its stream's error
    (OpenAI's event then [DONE], as vLLM ends a failed stream; LMI's error line)."""

    def __init__(self, send: Send):
        self._send = send
        self.started = self.ended = False
        self.content_type = b""

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.content_type = dict(message.get("headers") or []).get(b"content-type", b"")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def cut_off(self, message: str, lmi: bool, retry_after_s: int) -> None:
        if not self.started:
            return await _send(self.send, _error(503, message, lmi, retry_after_s))
        if self.ended:
            return
        if self.content_type.startswith(b"text/event-stream"):
            tail = b"data: " + openai_error(503, message).body + b"\n\ndata: [DONE]\n\n"
        elif self.content_type.startswith(b"application/jsonlines"):
            tail = jsonline({"error": message, "code": 503})
        else:  # a whole answer half sent: end it; the client sees a short body
            tail = b""
        await self.send({"type": "http.response.body", "body": tail, "more_body": False})


class _Collected:
    """A whole response captured from the inner app."""

    def __init__(self):
        self.status, self.body = 0, b""

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


def _with_retry_after(send: Send, state: FrontState) -> Send:
    """`send` with Retry-After added to a 503 (vLLM's admission) and the refusal counted."""

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            if state._stopping_now is None:  # (a stop-now's own 503s are not admission's)
                state.refuse("queue_full")
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"retry-after"]
            message = dict(message, headers=headers + [(b"retry-after", str(state.retry_after_s).encode())])
        await send(message)

    return wrapped


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives `body` first, then the client's own messages (a disconnect reaches vLLM)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send(send: Send, response: Response) -> None:
    """A whole Starlette response through `send`."""
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


def _error(status: int, message: str, lmi: bool, retry_after_s: int | None = None) -> Response:
    """One error in the route's shape, as lmc's own routes write it: LMI's {"error", "code"}
    (core.error_response) or OpenAI's {"error": {"message", "type", "code"}} (openai_api.openai_error)."""
    response = error_response(status, message) if lmi else openai_error(status, message)
    if retry_after_s is not None:
        response.headers["retry-after"] = str(retry_after_s)
    return response


def _message(error: Any) -> str:
    if isinstance(error, dict):
        return " ".join(str(error.get("message") or error).split())
    return " ".join(str(error).split())


def _vllm_error(body: bytes) -> str:
    """The message of one of vLLM's error bodies ({"error": {"message": ...}}, or FastAPI's {"detail": ...})."""
    try:
        decoded = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip() or "the engine failed"
    if isinstance(decoded, dict):
        if "error" in decoded:
            return _message(decoded["error"])
        if "detail" in decoded:
            return _message(decoded["detail"])
        if "message" in decoded:
            return _message(decoded["message"])
    return _message(decoded)


# ---------------------------------------------------------------- /metrics

class FrontCollector:
    """lmc's series, in prometheus_client's registry beside vLLM's (its /metrics renders both)."""

    def __init__(self, state: FrontState):
        self.state = state

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = self.state
        info = GaugeMetricFamily("lmc_info", "lmc serving this artifact (value 1)",
                                 labels=["lmc_version", "plan_sha256", "model", "engine"])
        info.add_metric([state.lmc_version, state.plan_sha256, state.model_name, "vllm"], 1)
        yield info
        yield GaugeMetricFamily("lmc_requests_in_flight", "Generation requests being answered", value=state.in_flight)
        refused = CounterMetricFamily("lmc_requests_refused", "Requests lmc or vLLM's admission refused, by reason",
                                      labels=["reason"])
        for reason in ("queue_full", "body_too_large", "shutting_down", "node_lost", "engine_dead"):
            refused.add_metric([reason], state.refused.get(reason, 0))
        yield refused
        if state.adapters:
            requests = CounterMetricFamily("lmc_adapter_requests", "Requests that selected each LoRA adapter (by "
                                           "`model`, or LMI's `adapters`)", labels=["adapter"])
            for name in state.adapters:
                requests.add_metric([name], state.adapter_requests.get(name, 0))
            yield requests
