"""The SageMaker / LMI routes: GET /ping (and /health), POST /invocations (the LMI schema), GET /metrics.

Every failure is a one-line JSON error: 400 bad input, 413 body too large, 424 model failure or
timeout, 503 queue full / not accepting (and 499 in the metrics for a client that left).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lmc.runtime.core import LineStream, Runtime, error_response
from lmc.runtime.jobs import CLIENT_CLOSED, Job, RequestFailed
from lmc.runtime.requests import LmiLines, jsonline, lmi_details, parse_invocation


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
        return LineStream(_jsonlines(runtime, jobs[0], details, started), "application/jsonlines")
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



def lmi_routes() -> list[Route]:
    return [Route("/ping", ping, methods=["GET"]),
            Route("/health", ping, methods=["GET"]),  # what vLLM and TGI users probe (Kubernetes), same answer
            Route("/invocations", invocations, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"])]
