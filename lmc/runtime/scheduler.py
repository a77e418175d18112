"""lmc's own backend (see jobs.Backend): jobs in one bounded queue, handed to worker groups, events back.

A dispatcher coroutine per worker group pulls work from the shared queue; the group's supervisor thread
(workers.py) reports tokens and results, which hop onto the event loop and into each job's events.
The plan's `scheduling` says how work is handed out:

  dynamic     a batch (up to batch_size jobs, or what came within max_batch_delay) goes to an idle
              group and runs to its longest request; the next batch waits for it.
  continuous  each job goes to its group on its own as soon as the group has a sequence slot
              (kv_cache.max_concurrent_sequences) and KV blocks for its prompt + max_new_tokens
              (kv_cache.blocks of kv_cache.block_size positions); it joins the running rows at the
              group's next decode step and its result comes back the step it finishes.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any, Callable

from lmc.runtime.batching import AsyncBatcher, BatchQueue, QueueFull
from lmc.runtime.engines.base import GenerationResult, Piece
from lmc.runtime.jobs import Job, RequestFailed
from lmc.runtime.metrics import Metrics
from lmc.runtime.workers import groups_per_instance

# A batch running this much longer than the request timeout means a hung group: restart it.
_HUNG_GRACE_S = 30.0


class Scheduler:
    """Jobs in, batches out to worker groups, events back to jobs. Lives on the event loop; the
    `on_*` methods are the `GroupEvents` called from supervisor threads and hop onto the loop."""

    def __init__(self, plan: dict[str, Any], metrics: Metrics, group_factory: Callable[[int, Any], Any],
                 request_timeout_s: float):
        self.plan = plan
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.continuous = plan.get("scheduling") == "continuous"
        kv = plan.get("kv_cache") or {}
        # A continuous plan runs up to batch_size sequences per group (vLLM's max_num_seqs), fewer when its
        # KV pool holds fewer; without a pool (an older plan), batch_size and no block limit.
        self.max_sequences = min(int(plan["batch_size"]), int(kv.get("max_concurrent_sequences") or plan["batch_size"]))
        self.block_size = int(kv.get("block_size") or 16)
        self.blocks = int(kv.get("blocks") or 0)
        if self.continuous:  # jobs leave the queue at once, as many as there are free slots
            queue = BatchQueue(int(plan["job_queue_size"]), self.max_sequences, 0.0)
        else:
            queue = BatchQueue(int(plan["job_queue_size"]), int(plan["batch_size"]), int(plan["max_batch_delay_ms"]) / 1000.0)
        self.batcher: AsyncBatcher[Job] = AsyncBatcher(queue)
        self.group_count = groups_per_instance(plan)
        self.groups = [group_factory(index, self) for index in range(self.group_count)]
        self._ready = [asyncio.Event() for _ in self.groups]
        self._batches: dict[int, dict[str, Job]] = {}
        self._batch_done: dict[int, asyncio.Future] = {}
        self._batch_ids = itertools.count(1)
        self._running: list[dict[int, int]] = [{} for _ in self.groups]  # per group: batch id -> KV blocks reserved
        self._kv_held = [0 for _ in self.groups]  # per group: KV blocks its cache holds, as rank 0 last reported
        self._owner: dict[int, int] = {}  # batch id -> group
        self._room = [asyncio.Event() for _ in self.groups]  # set when a group's running work shrinks
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early: list[tuple] = []  # events that arrived before the event loop ran
        self._loop_lock = threading.Lock()
        self._stopping = False
        self.fatal: Exception | None = None  # a group that cannot load the model: the server stops
        self.on_fatal_hook: Callable[[], None] | None = None
        # Read when /metrics is scraped, so they can never be stale.
        metrics.queue_depth.set_function(self.queued)
        metrics.waiting.set_function(self.queued)
        metrics.running.set_function(lambda: sum(len(jobs) for jobs in self._batches.values()))
        metrics.kv_blocks_used.set_function(lambda: sum(self._kv_held))
        metrics.kv_blocks_free.set_function(
            lambda: sum(max(0, self.blocks - held) for held in self._kv_held) if self.blocks else 0)
        metrics.kv_blocks_reserved.set_function(lambda: sum(sum(held.values()) for held in self._running))
        metrics.groups_ready.set_function(lambda: sum(event.is_set() for event in self._ready))

    @property
    def capacity(self) -> int:
        return self.batcher.queue.capacity

    def queued(self) -> int:
        return len(self.batcher.queue)

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
            dispatch = self._dispatch_continuous if self.continuous else self._dispatch
            self._tasks.append(asyncio.create_task(dispatch(index), name=f"lmc-dispatch-{index}"))

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
        """Dynamic batching: the next batch goes to group `index` once it has finished the last one."""
        while True:
            jobs = await self._take(index, None)
            if jobs and self._send(index, jobs, 0):
                self.metrics.batch_size.observe(len(jobs))
                await self._batch_done[jobs[0].batch[1]]
            elif jobs:
                self.batcher.requeue(jobs)
                await asyncio.sleep(0)

    async def _take(self, index: int, limit: int | None) -> list[Job]:
        """Jobs for group `index` once it is ready (none when it went down meanwhile: they are requeued)."""
        await self._ready[index].wait()
        jobs = [job for job in await self.batcher.next_batch(limit) if not job.finished]
        if jobs and not self._ready[index].is_set():  # went down while we waited for work
            self.batcher.requeue(jobs)
            await asyncio.sleep(0)
            return []
        return jobs

    async def _dispatch_continuous(self, index: int) -> None:
        """Continuous batching: jobs go to group `index` one by one while it has a sequence slot and the
        KV blocks each needs (see the module doc); each is a batch of one, answered when it finishes."""
        room = self._room[index]
        while True:
            await self._ready[index].wait()
            room.clear()
            free = self.max_sequences - len(self._running[index])
            if free <= 0:
                await room.wait()
                continue
            jobs = await self._take(index, free)
            if not jobs:
                continue
            held = sum(self._running[index].values())
            fits = []
            for job in jobs:
                need = self._blocks_for(job)
                # One that needs more than the whole pool still runs alone (the pool is the plan's estimate).
                if self.blocks and held + need > self.blocks and (self._running[index] or fits):
                    break
                fits.append((job, need))
                held += need
            self.batcher.requeue(jobs[len(fits):])
            for sent, (job, need) in enumerate(fits):
                if not self._send(index, [job], need):
                    self.batcher.requeue([job for job, _ in fits[sent:]])
                    break
            if len(fits) < len(jobs) and self._running[index]:
                await room.wait()  # the head of the queue waits for blocks

    def _blocks_for(self, job: Job) -> int:
        return -(-(job.prompt_tokens + job.request.params.max_new_tokens) // self.block_size)

    def _send(self, index: int, jobs: list[Job], blocks: int) -> bool:
        """Hand `jobs` to group `index` as one batch (False when the group is down: requeue them)."""
        batch_id = next(self._batch_ids)
        try:
            self.groups[index].submit(batch_id, [job.request for job in jobs], [job.id for job in jobs if job.stream])
        except RuntimeError:  # it went down; its on_down is still on its way to this loop
            self._set_ready(index, False)  # wait for on_ready instead of spinning on the same jobs
            return False
        self._batches[batch_id] = {job.id: job for job in jobs}
        self._running[index][batch_id] = blocks
        self._owner[batch_id] = index
        self._observe_queue_time(jobs)
        for job in jobs:
            job.batch = (index, batch_id)
        done = self._loop.create_future()
        self._batch_done[batch_id] = done
        self._tasks.append(asyncio.create_task(self._watch(index, batch_id, done)))
        return True

    async def _watch(self, index: int, batch_id: int, done: asyncio.Future) -> None:
        """Restart group `index` when batch `batch_id` runs far past the request timeout (a hung group)."""
        try:
            await asyncio.wait_for(asyncio.shield(done), self.request_timeout_s + _HUNG_GRACE_S)
        except asyncio.TimeoutError:  # the supervisor fails the batch once the processes are gone
            self.groups[index].kill(f"batch {batch_id} ran {self.request_timeout_s + _HUNG_GRACE_S:g}s")
        finally:
            task = asyncio.current_task()
            if task in self._tasks:
                self._tasks.remove(task)

    def _observe_queue_time(self, jobs: list[Job]) -> None:
        now = time.monotonic()
        for job in jobs:
            self.metrics.queue_time.observe(now - job.enqueued_at)

    def _release(self, batch_id: int) -> None:
        index = self._owner.pop(batch_id, None)
        if index is not None:
            self._running[index].pop(batch_id, None)
            self._room[index].set()

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
        self._kv_held[group] = 0  # its processes, and their caches, are gone
        self._call(self._set_ready, group, False)

    def on_restart(self, group: int) -> None:
        self.metrics.restarts.inc()  # not on_down: a fatal load failure or a drain restarts nothing

    def on_fatal(self, group: int, error: Exception) -> None:
        self._call(self._fatal, error)

    def on_token(self, group: int, batch_id: int, request_id: str, piece: Piece) -> None:
        self._call(self._token, batch_id, request_id, piece)

    def on_tokens(self, group: int, pieces: list[tuple[int, str, Piece]]) -> None:
        self._call(self._tokens, pieces)  # one hop onto the loop for a whole step's pieces

    def _tokens(self, pieces: list[tuple[int, str, Piece]]) -> None:
        for batch_id, request_id, piece in pieces:
            self._token(batch_id, request_id, piece)

    def on_result(self, group: int, batch_id: int, results: list) -> None:
        self._call(self._result, batch_id, results)

    def on_failure(self, group: int, batch_id: int, message: str) -> None:
        self._call(self._failure, batch_id, message)

    def on_steps(self, group: int, rows: list[int], kv_blocks: int) -> None:
        for count in rows:  # (prometheus_client is thread-safe)
            self.metrics.tokens_per_step.observe(count)
        self._kv_held[group] = kv_blocks

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
        self._release(batch_id)
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



def worker_scheduler(model_dir, plan: dict[str, Any], metrics: Metrics, request_timeout_s: float, *,
                     group_factory: Callable[[int, Any], Any] | None = None, worker_env: dict[str, str] | None = None,
                     worker_gate=None) -> Scheduler:
    """The Scheduler over the plan's worker groups (workers.WorkerGroup, unless `group_factory`)."""
    if group_factory is None:
        from lmc.runtime.workers import WorkerGroup

        def group_factory(index: int, events) -> WorkerGroup:
            return WorkerGroup(model_dir, plan, index, events, extra_env=worker_env, gate=worker_gate)
    return Scheduler(plan, metrics, group_factory, request_timeout_s)
