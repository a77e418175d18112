"""Worker groups: TP ranks in lockstep over gloo, a rank killed with -9 mid-request, replicas."""

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from lmc.runtime.server import Runtime
from runtime_fakes import ServerThread, expected_text, fake_plan, write_artifact

pytestmark = pytest.mark.slow


def _serve(root, plan, engine_kwargs):
    model = write_artifact(root / "m", plan, engine_kwargs)
    return ServerThread(Runtime(model, plan, request_timeout_s=30))


def _records(record):
    path = record / "batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _pid_of(record, rank, exclude=()):
    pids = [int(p.read_text()) for p in record.glob(f"rank{rank}.*.pid")]
    live = [pid for pid in pids if pid not in exclude]
    assert len(live) == 1, live
    return live[0]


@pytest.mark.parametrize("scheduling", ["dynamic", "continuous"])
def test_killing_a_rank_fails_its_request_and_the_group_comes_back(tmp_path, scheduling):
    record = tmp_path / "record"
    record.mkdir()
    plan = fake_plan(tensor_parallel_degree=2, max_batch_delay_ms=0, scheduling=scheduling)
    with _serve(tmp_path, plan, {"step_delay_s": 0.1, "record_dir": str(record)}) as srv:
        srv.wait_ready(60)
        ok = httpx.post(srv.url + "/invocations", json={"inputs": "warm up", "parameters": {"max_new_tokens": 2}})
        assert ok.status_code == 200
        assert sorted(r["rank"] for r in _records(record)) == [0, 1]  # both ranks ran the batch
        victim = _pid_of(record, 1)

        answer = {}
        thread = threading.Thread(target=lambda: answer.update(reply=httpx.post(
            srv.url + "/invocations", json={"inputs": "doomed request", "parameters": {"max_new_tokens": 40}}, timeout=30)))
        thread.start()
        deadline = time.monotonic() + 10
        while len(_records(record)) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)  # until both ranks are generating
        os.kill(victim, signal.SIGKILL)
        thread.join(30)
        reply = answer["reply"]
        assert reply.status_code == 424
        assert "worker process rank 1" in reply.json()["error"] and "killed by signal 9" in reply.json()["error"]

        assert httpx.get(srv.url + "/ping").status_code == 503  # down until the new group is ready
        srv.wait_ready(60)
        assert _pid_of(record, 1, exclude={victim}) != victim
        again = httpx.post(srv.url + "/invocations", json={"inputs": "back again", "parameters": {"max_new_tokens": 3}})
        assert again.json() == {"generated_text": expected_text("back again", 3)}
        metrics = httpx.get(srv.url + "/metrics").text
        assert "lmc_worker_group_restarts_total 1.0" in metrics


def test_requests_spread_over_replicas(tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    plan = fake_plan(replicas=2, batch_size=2, max_batch_delay_ms=0, job_queue_size=64)
    with _serve(tmp_path, plan, {"step_delay_s": 0.02, "record_dir": str(record)}) as srv:
        srv.wait_ready(60)

        async def main():
            async with httpx.AsyncClient(timeout=30) as client:
                replies = await asyncio.gather(*(client.post(srv.url + "/invocations", json={
                    "inputs": f"r {i}", "parameters": {"max_new_tokens": 5}}) for i in range(16)))
                return [r.json() for r in replies]

        bodies = asyncio.run(main())
        assert bodies == [{"generated_text": expected_text(f"r {i}", 5)} for i in range(16)]
        per_process = {}
        for r in _records(record):
            per_process[r["pid"]] = per_process.get(r["pid"], 0) + r["size"]
        assert len(per_process) == 2 and min(per_process.values()) >= 4, per_process


def test_a_transient_load_failure_is_retried_not_fatal(tmp_path):
    """A plain exception while loading (not an LmcError) may pass: the group is restarted, and the
    scheduler is not told to give up. Here rank 1's first two loads fail; the third serves."""
    record = tmp_path / "record"
    record.mkdir()
    plan = fake_plan(tensor_parallel_degree=2)
    with _serve(tmp_path, plan, {"load_crash_rank": 1, "load_crashes": 2, "record_dir": str(record)}) as srv:
        srv.wait_ready(60)
        group = srv.runtime.scheduler.groups[0]
        assert group.restarts == 2 and group.fatal is None and srv.runtime.scheduler.fatal is None
        reply = httpx.post(srv.url + "/invocations", json={"inputs": "at last", "parameters": {"max_new_tokens": 3}})
        assert reply.json() == {"generated_text": expected_text("at last", 3)}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_load_that_fails_every_time_gives_up_after_three_attempts(tmp_path, rank):
    """A load that raises on every attempt (a file the manifest vouches for but the model cannot use) is
    not restarted forever while /ping answers 503: after LOAD_ATTEMPTS in a row the group gives up, and
    the server stops with one line (rank 0 says why; another rank's reason is in its log)."""
    from lmc.runtime.workers import LOAD_ATTEMPTS

    plan = fake_plan(tensor_parallel_degree=2)
    with _serve(tmp_path, plan, {"load_crash_rank": rank}) as srv:
        deadline = time.monotonic() + 60
        while srv.runtime.scheduler.fatal is None and time.monotonic() < deadline:
            time.sleep(0.1)
        fatal = srv.runtime.scheduler.fatal
        assert fatal is not None and fatal.exit_code == 1
        reason = "RuntimeError: a load failure" if rank == 0 else "rank 1 failed to load it (its log says why)"
        assert str(fatal) == f"worker group 0 cannot load the model: {reason} ({LOAD_ATTEMPTS} attempts in a row failed)"
        assert srv.runtime.scheduler.groups[0].restarts == LOAD_ATTEMPTS - 1


def test_a_fatal_load_failure_stops_the_group_and_tells_the_scheduler(tmp_path):
    plan = fake_plan(tensor_parallel_degree=2)
    with _serve(tmp_path, plan, {"load_error": "no SDK here"}) as srv:
        deadline = time.monotonic() + 30
        while srv.runtime.scheduler.fatal is None and time.monotonic() < deadline:
            time.sleep(0.1)
        fatal = srv.runtime.scheduler.fatal
        assert fatal is not None and fatal.exit_code == 1
        assert str(fatal) == "worker group 0 cannot load the model: no SDK here"
        assert srv.runtime.scheduler.groups[0].restarts == 0
        assert "lmc_worker_group_restarts_total 0.0" in srv.runtime.metrics.render().decode()  # nothing restarted


class _Rank0:
    """Rank 0's serve loop (world size 1) in a thread, over a real Pipe, as the supervisor drives it."""

    def __init__(self, step_delay_s: float = 0.05):
        import multiprocessing

        from lmc.runtime import workers
        from runtime_fakes import FakeEngine

        self.front, end = multiprocessing.Pipe(duplex=True)
        self.errors: list[str] = []

        def run():
            try:
                workers._serve_loop(FakeEngine(step_delay_s=step_delay_s), workers.WorkerSpec("-", 0, 0, 1, "none"), end, None)
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                self.errors.append(repr(exc))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def batch(self, batch_id: int, *rows: tuple[str, int]) -> None:
        from lmc.runtime.engines.base import GenerationParams, GenerationRequest

        self.front.send(("batch", batch_id, [GenerationRequest(rid, "a b c", GenerationParams(max_new_tokens=n))
                                             for rid, n in rows], []))

    def answer(self, timeout_s: float = 10.0) -> tuple:
        while self.front.poll(timeout_s):
            message = self.front.recv()
            if message[0] != "token":
                return message
        raise AssertionError("rank 0 sent no answer")


def test_rank0_ignores_a_cancel_that_comes_after_its_batch_ended():
    """abandon() can run while the result is on its way: the late cancel must not be read as a batch."""
    rank0 = _Rank0()
    rank0.batch(1, ("x", 3))
    assert rank0.answer()[0] == "result"
    rank0.front.send(("cancel", 1, "x"))
    rank0.batch(2, ("y", 3))
    kind, batch_id, results = rank0.answer()
    assert (kind, batch_id, [(r.id, r.finish_reason) for r in results]) == ("result", 2, [("y", "length")])
    assert rank0.errors == []


def test_rank0_cancels_only_rows_of_its_running_batch():
    rank0 = _Rank0()
    rank0.batch(2, ("x", 20), ("y", 20))
    time.sleep(0.2)
    rank0.front.send(("cancel", 1, "y"))  # another batch's request of the same id: not this row
    rank0.front.send(("cancel", 2, "x"))
    kind, _, results = rank0.answer()
    assert kind == "result"
    x, y = results
    assert x.finish_reason == "cancelled" and x.generated_tokens < 20 and (y.finish_reason, y.generated_tokens) == ("length", 20)
    assert rank0.errors == []


def test_a_stop_during_a_batch_stops_its_rows_answers_then_ends_rank0():
    """The front end stops a group mid-batch only when its drain gave up: nobody will read the rows."""
    rank0 = _Rank0()
    rank0.batch(1, ("x", 200), ("y", 200))
    time.sleep(0.2)
    rank0.front.send(("stop",))
    kind, _, results = rank0.answer()
    assert kind == "result" and [r.finish_reason for r in results] == ["cancelled", "cancelled"]
    assert all(r.generated_tokens < 200 for r in results)
    rank0.thread.join(5)
    assert not rank0.thread.is_alive() and rank0.errors == []


def test_rank0_stops_cleanly_when_the_front_end_goes_away_mid_batch():
    rank0 = _Rank0()
    rank0.batch(1, ("x", 200))
    time.sleep(0.2)
    rank0.front.close()
    rank0.thread.join(5)  # the rows are given up at once (200 steps would take 10 s), no traceback
    assert not rank0.thread.is_alive() and rank0.errors == []
