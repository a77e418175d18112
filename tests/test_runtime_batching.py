"""The pure batching logic (explicit clock) and its event-loop wrapper."""

import asyncio
from dataclasses import dataclass

import pytest

from lmc.runtime.batching import AsyncBatcher, BatchQueue, QueueFull


@dataclass(eq=False)
class J:
    name: str
    enqueued_at: float


def jobs(*names, at=0.0):
    return [J(n, at) for n in names]


def test_batch_is_cut_when_batch_size_jobs_wait():
    q = BatchQueue(capacity=10, batch_size=3, delay_s=1.0)
    q.offer(jobs("a", "b"))
    assert q.take(now=0.0) is None
    assert q.seconds_until_ready(0.25) == pytest.approx(0.75)
    q.offer(jobs("c", "d"))
    assert [j.name for j in q.take(now=0.0)] == ["a", "b", "c"]
    assert len(q) == 1


def test_partial_batch_leaves_after_the_delay_since_the_oldest_job():
    q = BatchQueue(capacity=10, batch_size=8, delay_s=0.05)
    q.offer(jobs("a", at=1.0))
    q.offer(jobs("b", at=1.04))
    assert q.take(now=1.049) is None
    assert [j.name for j in q.take(now=1.05)] == ["a", "b"]
    assert q.take(now=9.0) is None and q.seconds_until_ready(9.0) is None


def test_full_queue_refuses_the_whole_request_and_says_so():
    q = BatchQueue(capacity=3, batch_size=2, delay_s=0.0)
    q.offer(jobs("a", "b"))
    with pytest.raises(QueueFull, match=r"queue is full \(2 of 3 waiting\)"):
        q.offer(jobs("c", "d"))  # all or nothing: a list input is one request
    assert len(q) == 2
    q.offer(jobs("c"))
    assert len(q) == 3


def test_removed_and_requeued_jobs_keep_fifo_order():
    q = BatchQueue(capacity=5, batch_size=2, delay_s=0.0)
    a, b, c = jobs("a", "b", "c")
    q.offer([a, b, c])
    assert q.remove(b) and not q.remove(b)
    batch = q.take(0.0)
    assert [j.name for j in batch] == ["a", "c"]
    q.offer(jobs("d"))
    q.requeue(batch)
    assert [j.name for j in q.drain()] == ["a", "c", "d"]


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="batch_size=0"):
        BatchQueue(capacity=1, batch_size=0, delay_s=0)


def test_async_batcher_waits_for_the_delay_then_returns_what_arrived():
    async def scenario():
        clock = asyncio.get_running_loop().time
        batcher = AsyncBatcher(BatchQueue(capacity=10, batch_size=4, delay_s=0.05), clock=clock)
        waiter = asyncio.create_task(batcher.next_batch())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # nothing queued yet
        start = clock()
        batcher.submit([J("a", start)])
        await asyncio.sleep(0.01)
        batcher.submit([J("b", clock())])
        batch = await asyncio.wait_for(waiter, 1.0)
        return [j.name for j in batch], clock() - start

    names, waited = asyncio.run(scenario())
    assert names == ["a", "b"]
    assert waited >= 0.045  # it waited for the delay (and returned within wait_for's 1 s)


def test_async_batcher_returns_a_full_batch_at_once():
    async def scenario():
        clock = asyncio.get_running_loop().time
        batcher = AsyncBatcher(BatchQueue(capacity=10, batch_size=2, delay_s=5.0), clock=clock)
        batcher.submit([J("a", clock()), J("b", clock()), J("c", clock())])
        first = await asyncio.wait_for(batcher.next_batch(), 1.0)
        return [j.name for j in first], len(batcher.queue)

    assert asyncio.run(scenario()) == (["a", "b"], 1)
