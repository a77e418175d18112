"""OpenAI-compatible routes: POST /v1/completions and /v1/chat/completions (SSE when streaming).

Requests are translated into the LMI parameters and validated by the same parser as /invocations,
then go through the same queue and batches. OpenAI semantics: sampling by default (temperature 1),
temperature 0 means greedy; `max_tokens` defaults to 16 for completions and, for chat, to the planned
answer length (the spec's max_output_tokens) within what fits.
As in vLLM, what the model's generation_config.json sets (temperature, top_p, top_k,
repetition_penalty; max_new_tokens for chat) replaces those defaults when a request leaves a field out
(`lmc runtime --generation-config none` turns that off). A chat prompt is tokenized without adding
special tokens (its template wrote them), a completion prompt with them; `add_special_tokens` (a vLLM
extension) overrides either.

The client contract is vLLM's, so that a client written against one engine works on the other: a body
must be declared JSON (`Content-Type: application/json`, else 400), and `model`, when given, must be the
served name (`GET /v1/models`; the spec's model.id), else 404 in vLLM's error shape.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from itertools import accumulate
from dataclasses import replace
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lmc.runtime.core import LineStream, Runtime
from lmc.runtime.jobs import CLIENT_CLOSED, Job, RequestFailed
from lmc.runtime.requests import parse_parameters

# Keys clients commonly send that do not change generation here; anything else unknown is a 400.
# (echo, suffix, best_of and response_format are checked in _check_body: only no-op values pass; n and
# logprobs are read where the request is made.)
_IGNORED = {"model", "user", "stream_options", "n", "logprobs", "echo", "best_of", "suffix", "top_logprobs",
            "max_completion_tokens", "response_format", "parallel_tool_calls", "metadata", "store", "service_tier"}
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty", "frequency_penalty",
             "presence_penalty", "logit_bias")
# vLLM's extensions that benchmark clients send, and their LMI parameter names.
_EXTENSIONS = {"min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos_token"}
_USED = {"prompt", "messages", "max_tokens", "stream", "add_special_tokens", *_SAMPLING, *_EXTENSIONS}


def openai_error(status: int, message: str, kind: str | None = None, param: str | None = None) -> JSONResponse:
    """OpenAI's error shape as vLLM's server writes it (its ErrorResponse: error.message, type, param, code;
    clients read error.message), plus the top-level code every lmc route has."""
    kind = kind or ("invalid_request_error" if status < 500 and status != 424 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}, "code": status},
                        status_code=status)


class ModelNotFound(Exception):
    """A request names a model this server does not serve: vLLM's 404."""


def check_model(body: dict[str, Any], served: str) -> None:
    """vLLM's rule for `model`: absent, null or empty means the served model; otherwise it must be the served
    name (vLLM's --served-model-name, which lmc sets to the spec's model.id; vLLM does not take the
    checkpoint's path either). ModelNotFound with vLLM's message otherwise."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("model must be a string")
    if model and model != served:
        raise ModelNotFound(f"The model `{model[:200]}` does not exist. Valid aliases: {served}.")


# vLLM answers a body that is not declared JSON with this 400 (its validate_json_request), before reading it.
UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


def declares_json(request: Request) -> bool:
    """Whether the request's Content-Type is application/json (any case, any parameters), as vLLM requires
    on its OpenAI routes. (curl -d sends application/x-www-form-urlencoded unless told otherwise.)"""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower() == "application/json"


def _finish_reason(engine_reason: str) -> str:
    return "length" if engine_reason == "length" else "stop"


def _check_body(body: Any, required: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    if required not in body:
        raise ValueError(f"request body has no '{required}'")
    other = "prompt" if required == "messages" else "messages"  # the other route's input: never silently ignored
    unknown = sorted(set(body) - _USED - _IGNORED | ({other} & set(body)))
    if unknown:
        raise ValueError(f"unsupported field {unknown[0][:40]!r}")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if body.get("echo") is not None and body["echo"] is not False:
        raise ValueError("echo is not supported")
    if body.get("suffix") not in (None, ""):
        raise ValueError("suffix is not supported")
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of not in (1, n or 1)):
        raise ValueError("best_of must be 1 (or equal to n): lmc returns every sampled answer")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ValueError("response_format: only {\"type\": \"text\"} is supported (no JSON mode or schemas)")
    if body.get("stream") is None:  # OpenAI's schema: boolean or null, default false
        body.pop("stream", None)
    elif not isinstance(body["stream"], bool):
        raise ValueError("stream must be true or false")
    return body


def _params(body: dict[str, Any], default_max_tokens: int, max_sequence_length: int,
            defaults: dict[str, Any] | None = None):
    """The LMI parameters for an OpenAI body; `defaults` (the model's) fill the sampling fields it leaves out."""
    max_tokens = body.get("max_completion_tokens") if body.get("max_tokens") is None else body.get("max_tokens")
    lmi: dict[str, Any] = {"max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
                           "do_sample": True}
    for key, lmi_key in _EXTENSIONS.items():
        if body.get(key) is not None:
            lmi[lmi_key] = body[key]
    for key in _SAMPLING:
        if body.get(key) is not None:
            lmi[key] = body[key]
        elif defaults and key in defaults:
            lmi[key] = defaults[key]
    try:
        return parse_parameters(lmi, max_sequence_length)
    except ValueError as exc:  # name the OpenAI field, not the LMI one
        message = str(exc).replace("parameters.", "").replace("max_new_tokens", "max_tokens")
        for key, lmi_key in _EXTENSIONS.items():
            message = message.replace(lmi_key, key)
        raise ValueError(message) from None


MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default limit


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per token the answer reports (None: no logprobs). Completions: `logprobs: k`;
    chat: `logprobs: true` with `top_logprobs: k`."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs not in (None, True, False):
            raise ValueError("logprobs must be true or false")
        if top is not None and not logprobs:
            raise ValueError("top_logprobs needs logprobs = true")
        count = (top or 0) if logprobs else None
    else:
        if top is not None:
            raise ValueError("top_logprobs is a chat field; completions take logprobs = k")
        count = None if logprobs is None or logprobs is False else logprobs  # 0 is on: the sampled token only
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_LOGPROBS:
        raise ValueError(f"{'top_logprobs' if chat else 'logprobs'} must be an integer in [0, {MAX_LOGPROBS}], got {count!r}")
    return count


# One generated token's logprobs: (its id, its log-probability, ((id, log-probability) of the most likely)).
Entry = tuple[int, float, tuple[tuple[int, float], ...]]


def _choice_logprobs(runtime: Runtime, result, chat: bool) -> dict[str, Any] | None:
    """OpenAI's logprobs object for one whole choice, from the engine's per-token entries."""
    if result.logprobs is None:
        return None
    entries = [(token_id, value, top) for token_id, (value, top) in zip(result.token_ids, result.logprobs)]
    return _logprobs_object(runtime.text.token_text, entries, chat)


def _logprobs_object(token_text, entries: list[Entry] | tuple[Entry, ...], chat: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object for `entries` (a whole choice, or a streamed chunk's tokens; completions'
    text_offset continues from `offset`, the token texts' length before them)."""
    if chat:
        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        return {"content": [dict(entry(token_id, value), top_logprobs=[entry(i, v) for i, v in top])
                            for token_id, value, top in entries]}
    texts = [token_text(token_id) for token_id, _, _ in entries]
    offsets = list(accumulate((len(text) for text in texts[:-1]), initial=offset))[:len(texts)]
    return {"tokens": texts, "token_logprobs": [value for _, value, _ in entries],
            # OpenAI: up to logprobs + 1 entries, the sampled token always among them
            "top_logprobs": [{**{token_text(i): v for i, v in top}, text: value}
                             for text, (_, value, top) in zip(texts, entries)], "text_offset": offsets}


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}] must be an object with a string 'role'")
        entry = {"role": message["role"], "content": _message_text(message.get("content"), index)}
        if isinstance(message.get("name"), str):  # templates may show who spoke (OpenAI's `name`)
            entry["name"] = message["name"]
        out.append(entry)
    return out


def _prompts(body: dict[str, Any]) -> list[str]:
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    raise ValueError("prompt must be a string or a non-empty list of strings (token arrays are not supported)")


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def _handle(request: Request, chat: bool) -> Response:
    runtime: Runtime = request.app.state.runtime
    endpoint = "chat_completions" if chat else "completions"
    started = time.monotonic()
    try:
        runtime.check_accepting()
        if not declares_json(request):
            raise RequestFailed(400, UNSUPPORTED_MEDIA_TYPE)
        raw = await runtime.read_json(request)
        try:
            body = _check_body(raw, "messages" if chat else "prompt")
            check_model(body, runtime.model_name)
            prompts = [runtime.text.render_chat(_messages(body))] if chat else _prompts(body)
            # A chat template writes the special tokens itself (BOS...): tokenizing its output must not add
            # them again. vLLM's default too, and its `add_special_tokens` field overrides it.
            special = body.get("add_special_tokens", not chat)
            if not isinstance(special, bool):
                raise ValueError("add_special_tokens must be true or false")
            defaults = runtime.sampling_defaults
            counts = await runtime.count_prompts(prompts, special)
            if chat:
                # Chat clients often omit max_tokens: default to the answer length the plan was made for
                # (generation_config.json's max_new_tokens when it sets one), within what the planned
                # sequence length leaves. vLLM defaults to all that room, but here a request's
                # max_new_tokens decides which requests can share a batch.
                room = runtime.max_sequence_length - counts[0]
                default_max = max(1, min(defaults.get("max_new_tokens", runtime.max_output_tokens), room))
                if isinstance(body.get("min_tokens"), int):  # a client asking for at least n tokens gets room for them
                    default_max = max(default_max, min(body["min_tokens"], room))
            else:
                default_max = 16
            params = replace(_params(body, default_max, runtime.max_sequence_length, defaults),
                             add_special_tokens=special, logprobs=_logprobs(body, chat))
        except ValueError as exc:
            raise RequestFailed(400, str(exc)) from None
        except ModelNotFound as exc:
            runtime.record(endpoint, 404)
            return openai_error(404, str(exc), "NotFoundError", "model")
        stream = body.get("stream", False)
        if stream and len(prompts) != 1:
            raise RequestFailed(400, "stream = true takes a single prompt, not a list")
        n = body.get("n") or 1
        jobs = _make_jobs(runtime, prompts, counts, params, n, stream, label="messages" if chat else "prompt")
        runtime.admit(jobs)
    except RequestFailed as exc:
        runtime.record(endpoint, exc.status)
        return openai_error(exc.status, exc.message)

    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    model = runtime.model_name
    if stream:
        return LineStream(_stream(runtime, jobs, chat, ident, created, model, _include_usage(body), started),
                          "text/event-stream")
    try:
        results = await runtime.results(jobs, request)
    except RequestFailed as exc:
        for job in jobs:
            runtime.scheduler.abandon(job)
        runtime.record(endpoint, exc.status, started)
        return openai_error(exc.status, exc.message)
    finally:
        runtime.release()
    prompt_tokens = sum(job.prompt_tokens for job in jobs[::n])  # each prompt once, however many choices
    completion_tokens = sum(result.generated_tokens for result in results)
    if chat:
        choices = [{"index": index, "message": {"role": "assistant", "content": result.text},
                    "finish_reason": _finish_reason(result.finish_reason),
                    "logprobs": _choice_logprobs(runtime, result, chat)} for index, result in enumerate(results)]
    else:
        choices = [{"index": index, "text": result.text, "finish_reason": _finish_reason(result.finish_reason),
                    "logprobs": _choice_logprobs(runtime, result, chat)} for index, result in enumerate(results)]
    runtime.record(endpoint, 200, started)
    return JSONResponse({"id": ident, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": model, "choices": choices,
                         "usage": _usage(prompt_tokens, completion_tokens)})


def _make_jobs(runtime: Runtime, prompts: list[str], counts: list[int], params, n: int, stream: bool,
               label: str) -> list[Job]:
    """`n` jobs per prompt, in OpenAI's choice order (prompt by prompt). With a seed, copy i samples with
    seed + i: one seed for all would give n identical answers. Each prompt is tokenized once (`counts`),
    not once per copy."""
    capacity = runtime.scheduler.capacity
    if n * len(prompts) > capacity:
        raise RequestFailed(400, f"n = {n} for {len(prompts)} prompt(s) is {n * len(prompts)} answers; the request "
                                 f"queue holds {capacity}")
    copies = [runtime.make_jobs(prompts, counts, params if params.seed is None else replace(params, seed=params.seed + i),
                                stream, label, length_field="max_tokens") for i in range(n)]
    return [copy[k] for k in range(len(prompts)) for copy in copies]


async def _stream(runtime: Runtime, jobs: list[Job], chat: bool, ident: str, created: int, model: str,
                  include_usage: bool, started: float) -> AsyncIterator[bytes]:
    """SSE chunks for the `n` choices of one prompt (`jobs`, choice i = jobs[i]), as their pieces come:
    each chunk one choice's text (and, with logprobs, its tokens'), its finish chunk when it ends, then
    usage (when asked) and [DONE] after the last."""
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, piece: str | None, finish: str | None, role: bool = False,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if piece is None else {"content": piece})
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": piece or "", "finish_reason": finish, "logprobs": logprobs}
        return {"id": ident, "object": kind_name, "created": created, "model": model, "choices": [choice]}

    status = 200
    offsets = [0] * len(jobs)  # completions' text_offset: each choice's token texts so far
    generated = 0
    try:
        if chat:
            for index in range(len(jobs)):
                yield _sse(chunk(index, None, None, role=True))
        async for index, kind, payload in _events(runtime, jobs):
            if kind == "token":
                logprobs = None
                if payload.logprobs:
                    logprobs = _logprobs_object(runtime.text.token_text, payload.logprobs, chat, offsets[index])
                    if not chat:
                        offsets[index] += sum(len(text) for text in logprobs["tokens"])
                if payload.text or logprobs:  # the last piece may be empty (an EOS): the finish chunk says it
                    yield _sse(chunk(index, payload.text, None, logprobs=logprobs))
            else:
                generated += payload.generated_tokens
                yield _sse(chunk(index, None, _finish_reason(payload.finish_reason)))
        if include_usage:
            yield _sse({"id": ident, "object": kind_name, "created": created, "model": model, "choices": [],
                        "usage": _usage(jobs[0].prompt_tokens, generated)})
        yield b"data: [DONE]\n\n"
    except RequestFailed as exc:
        status = exc.status
        yield _sse({"error": {"message": exc.message, "code": exc.status, "type": "server_error"}})
        yield b"data: [DONE]\n\n"  # as vLLM ends an errored stream: clients waiting for the sentinel stop
    except (asyncio.CancelledError, GeneratorExit):
        status = CLIENT_CLOSED
        raise
    finally:
        runtime.release()
        runtime.record("chat_completions" if chat else "completions", status, started)


async def _events(runtime: Runtime, jobs: list[Job]) -> AsyncIterator[tuple[int, str, Any]]:
    """(job index, kind, payload) for the events of `jobs` in the order they come (Runtime.events each),
    until every job is done; the first failure is raised and the other jobs are given up."""
    if len(jobs) == 1:
        async for kind, payload in runtime.events(jobs[0]):
            yield 0, kind, payload
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, job: Job) -> None:
        try:
            async for kind, payload in runtime.events(job):
                await merged.put((index, kind, payload))
        except Exception as exc:  # RequestFailed: a model failure or the timeout
            await merged.put((index, "failed", exc))

    tasks = [asyncio.create_task(pump(index, job)) for index, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            index, kind, payload = await merged.get()
            if kind == "failed":
                raise payload
            running -= kind == "done"
            yield index, kind, payload
    finally:  # cancelling a pump ends its Runtime.events, which gives its job up
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def models(request: Request) -> Response:
    """GET /v1/models: the one model served, under the id requests' `model` may name (clients and
    benchmark tools discover it here). `max_model_len` as vLLM reports it: the planned sequence length."""
    runtime: Runtime = request.app.state.runtime
    return JSONResponse({"object": "list", "data": [{
        "id": runtime.model_name, "object": "model", "created": runtime.started_at, "owned_by": "lmc",
        "max_model_len": runtime.max_sequence_length}]})


def openai_routes() -> list[Route]:
    return [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"])]
