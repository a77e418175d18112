"""The contract between the HTTP routes and a backend: `Job`, `RequestFailed`, and `Backend`.

The routes (lmi_api, openai_api) turn a request into `Job`s and hand them to the runtime's backend
(core.Runtime.scheduler). A backend is whatever generates: lmc's own worker groups (scheduler.py), or
another engine's server run in-process (vLLM). It never sees HTTP; it answers through each job's
`events` queue, on the event loop:

  ("token", Piece)*        pieces as they are generated (for every job: the first one times TTFT;
                           the routes stream them only for `job.stream`)
  ("done", GenerationResult)  the answer; nothing after it is read
  ("error", status, message)  the job failed (424 model failure, 503 shutting down, ...)

This module imports nothing of the runtime but the engine types, so any backend can depend on it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Protocol

from lmc.runtime.engines.base import GenerationRequest

# The status recorded in the metrics for a stream whose client went away (nginx's convention).
CLIENT_CLOSED = 499


class RequestFailed(Exception):
    """Answered as {"error": message, "code": status}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


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



class Backend(Protocol):
    """What the runtime needs from whatever generates (see the module doc for the events it sends).

    Lifecycle, in order: `start_groups()` (may run before the event loop, to overlap start-up work),
    `start()` on the event loop, then `submit`/`abandon` per request, `stop()` at the end;
    `stop_groups()` instead of `stop()` when start-up fails before serving."""

    capacity: int  # how many jobs may wait at once; more answer 503 (the plan's job_queue_size)
    group_count: int  # worker groups (replicas) this container runs, for the start-up log
    fatal: Exception | None  # set when the model cannot be served at all: the server stops, exit non-zero
    on_fatal_hook: Callable[[], None] | None  # called (on the loop) when `fatal` is set

    def start_groups(self) -> None: ...
    def start(self) -> None: ...
    async def stop(self) -> None: ...
    def stop_groups(self) -> None: ...

    def all_ready(self) -> bool:
        """Every worker group can take work (/ping answers 200)."""

    def submit(self, jobs: list[Job]) -> None:
        """Queue all of `jobs`, or raise RequestFailed(503) at once when there is no room."""

    def abandon(self, job: Job) -> None:
        """Nobody reads `job`'s answer any more (its client left, it timed out, it was answered): drop it
        from the queue, and stop generating for it wherever it runs. Called for every job, exactly once
        or more: must be cheap and idempotent."""

    def fail_all(self, status: int, message: str) -> None:
        """Fail every job queued or generating with `status` (the server stops now)."""

    def queued(self) -> int:
        """Jobs waiting (not yet generating), for /metrics."""


__all__ = ["Backend", "CLIENT_CLOSED", "Job", "RequestFailed"]
