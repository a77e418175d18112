"""Continuous batching end to end: a spec for the hf engine on this CPU with concurrency 16 (only the
engine, dtype and degree pinned) plans continuous batching, and the runtime serving its artifact (TP 2
over gloo) lets a short request finish while a long one is still decoding, with the answers each
request gets alone; /metrics reports the scheduler."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")

from lmc.cli.main import main  # noqa: E402
from lmc.runtime.server import Runtime  # noqa: E402
from lmc.runtime.startup import open_artifact  # noqa: E402
from runtime_fakes import ServerThread  # noqa: E402
from test_runtime_e2e import CPU_PROFILE, SPEC as E2E_SPEC  # noqa: E402

pytestmark = pytest.mark.slow

# The end-to-end tests' spec with 16 concurrent requests of up to 256 new tokens, replicas left to the planner.
SPEC = E2E_SPEC.replace("max_output_tokens = 16", "max_output_tokens = 256").replace(
    "concurrency = 4", "concurrency = 16").replace("replicas = {replicas}\n", "")
assert "concurrency = 16" in SPEC and "replicas" not in SPEC


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    from lmc.testing.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("continuous")
    checkpoint = make_checkpoint("llama", root / "ckpt")
    (root / "cpu2.toml").write_text(CPU_PROFILE)
    (root / "spec.toml").write_text(SPEC.format(family="llama", path=checkpoint.as_posix(), tp=2))
    assert main(["build", str(root / "spec.toml"), "--format", "dir", "-o", str(root / "artifact")]) == 0
    return root / "artifact"


@pytest.fixture(scope="module")
def server(artifact):
    served = open_artifact(artifact)
    with ServerThread(Runtime(served.model_dir, served.plan, request_timeout_s=120)) as srv:
        srv.wait_ready(180)
        srv.plan = served.plan
        yield srv


def _series(server) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.split(" ")[1])
            for line in httpx.get(server.url + "/metrics").text.splitlines() if line and line[0] != "#"}


def test_the_plan_is_continuous_with_a_kv_pool_and_says_why(artifact):
    plan = open_artifact(artifact).plan
    assert plan["scheduling"] == "continuous"
    kv = plan["kv_cache"]
    assert kv["block_size"] == 16 and kv["blocks"] >= kv["max_concurrent_sequences"] * (288 // 16) > 0
    [decision] = [d for d in plan["decisions"] if d["key"] == "scheduling"]
    assert "16 concurrent requests" in decision["reason"] and "join at the next decode step" in decision["reason"]
    assert "option.rolling_batch=disable" in (artifact / "serving.properties").read_text()


def _stream(url: str, prompt: str, tokens: int, log: dict, key: str) -> None:
    body = {"inputs": prompt, "stream": True,
            "parameters": {"max_new_tokens": tokens, "ignore_eos_token": True, "details": True}}
    with httpx.stream("POST", url + "/invocations", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.strip():
                log.setdefault(key + "_lines", []).append(json.loads(line))
                log.setdefault(key + "_first", time.monotonic())
    log[key + "_end"] = time.monotonic()


def test_a_short_request_finishes_while_a_long_one_decodes_with_its_alone_answer(server):
    alone = {prompt: httpx.post(server.url + "/invocations", timeout=120, json={
        "inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos_token": True}}).json()["generated_text"]
        for prompt, n in (("a long story about a fox", 240), ("short one", 8))}
    log: dict = {}
    long = threading.Thread(target=_stream, args=(server.url, "a long story about a fox", 240, log, "long"))
    long.start()
    deadline = time.monotonic() + 60
    while "long_first" not in log and time.monotonic() < deadline:
        time.sleep(0.005)
    _stream(server.url, "short one", 8, log, "short")
    during = _series(server)  # the long one still decoding (asserted below): its cache's blocks are held
    long_running = "long_end" not in log
    long.join(120)
    series = _series(server)
    assert long_running, "the long request ended before the short one's answer was read"
    # Rank 0 reported the blocks its paged cache holds at the step the short one left: the long row's
    # positions so far, within what the scheduler reserved for it (prompt + 240 new tokens).
    assert 0 < during["lmc_kv_cache_blocks_used"] <= during["lmc_kv_cache_blocks_reserved"]
    assert during["lmc_kv_cache_blocks_free"] == server.plan["kv_cache"]["blocks"] - during["lmc_kv_cache_blocks_used"]
    assert log["short_end"] < log["long_end"], "the short request waited for the long one"
    assert log["long_lines"][-1]["details"]["generated_tokens"] == 240
    assert log["short_lines"][-1]["generated_text"] == alone["short one"]
    assert log["long_lines"][-1]["generated_text"] == alone["a long story about a fox"]
    assert series["lmc_scheduler_running_requests"] == 0 and series["lmc_scheduler_waiting_requests"] == 0
    assert series["lmc_kv_cache_blocks_used"] == 0 and series["lmc_kv_cache_blocks_free"] == server.plan["kv_cache"]["blocks"]
    assert series["lmc_kv_cache_blocks_reserved"] == 0
    assert series["lmc_queue_time_seconds_count"] >= 4
    # Some step decoded both rows: the short one joined the running long one.
    assert series["lmc_scheduler_tokens_per_step_count"] > series['lmc_scheduler_tokens_per_step_bucket{le="1.0"}']


def test_a_client_that_leaves_stops_its_row_and_frees_its_slot(server):
    before = _series(server)["lmc_generated_tokens_total"]
    body = {"inputs": "a story nobody reads", "stream": True,
            "parameters": {"max_new_tokens": 250, "ignore_eos_token": True}}
    with httpx.stream("POST", server.url + "/invocations", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 30
    while _series(server)["lmc_generated_tokens_total"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    series = _series(server)
    # The row stopped once the cancel reached rank 0, well before its 250 tokens; its slot and blocks are free.
    assert 3 <= series["lmc_generated_tokens_total"] - before < 250
    assert series["lmc_scheduler_running_requests"] == 0 and series["lmc_kv_cache_blocks_used"] == 0
    after = httpx.post(server.url + "/invocations", timeout=60, json={"inputs": "next", "parameters": {"max_new_tokens": 4}})
    assert after.status_code == 200


def test_kv_gauges_follow_each_groups_report_and_a_group_that_goes_down_holds_nothing():
    from lmc.runtime.metrics import Metrics
    from lmc.runtime.scheduler import Scheduler

    plan = {"scheduling": "continuous", "batch_size": 4, "job_queue_size": 8, "replicas": 2, "max_batch_delay_ms": 0,
            "kv_cache": {"block_size": 16, "blocks": 100, "max_concurrent_sequences": 4}}
    metrics = Metrics(4)
    scheduler = Scheduler(plan, metrics, lambda index, events: None, request_timeout_s=1)

    def gauges() -> tuple[float, float]:
        read = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.render().decode().splitlines()
                if line.startswith("lmc_kv_cache_blocks_")}
        return read["lmc_kv_cache_blocks_used"], read["lmc_kv_cache_blocks_free"]

    assert gauges() == (0, 200)  # two groups, a pool of 100 each
    scheduler.on_steps(0, [3, 3], 7)
    scheduler.on_steps(1, [1], 2)
    assert gauges() == (9, 191)
    scheduler.on_steps(0, [2], 5)  # the latest report replaces the group's last one
    assert gauges() == (7, 193)
    scheduler.on_down(1, "rank 0 died")  # its processes, and so its cache, are gone
    assert gauges() == (5, 195)
