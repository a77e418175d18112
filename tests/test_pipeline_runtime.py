"""Pipeline parallelism across "instances" on this machine: two `lmc runtime` processes on one artifact,
joined as LeaderWorkerSet would join them (LWS_* env pointing at 127.0.0.1), answer as HF generate does
on the unpartitioned checkpoint; a bad or missing rendezvous is one line and exit 1, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from _engine_helpers import free_port, hf_greedy, make_checkpoint  # noqa: E402
from test_runtime_e2e import CPU_PROFILE, SPEC as E2E_SPEC  # noqa: E402

pytestmark = pytest.mark.slow
# Different lengths in one batch: left padding crosses the stage boundary with the hidden states.
PROMPTS = ["the quick brown fox jumps over the lazy dog", "hi", "Hello, world! How are you"]
NEW_TOKENS = [9, 5, 7]  # the second row finishes first: the stages drop its cache rows alike

# The end-to-end tests' spec, over `stages` "instances", one pipeline stage each.
SPEC = E2E_SPEC.replace('profile = "cpu2.toml"\n', 'profile = "cpu2.toml"\ninstances = {stages}\n').replace(
    "replicas = {replicas}\n", "pipeline_parallel_degree = {stages}\nreplicas = {replicas}\n")
assert "instances = {stages}" in SPEC and "pipeline_parallel_degree = {stages}" in SPEC


def build_pipeline_artifact(root: Path, checkpoint: Path, stages: int) -> Path:
    """`lmc build` of a spec pinned to `stages` pipeline stages (one "instance" each)."""
    from lmc.cli.main import main

    (root / "cpu2.toml").write_text(CPU_PROFILE)
    spec = root / "spec.toml"
    spec.write_text(SPEC.format(family="llama", path=checkpoint.as_posix(), tp=1, replicas=1, stages=stages))
    out = root / "artifact"
    assert main(["build", str(spec), "--format", "dir", "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def pipeline_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    checkpoint = make_checkpoint("llama", root / "ckpt", num_hidden_layers=3)
    return checkpoint, build_pipeline_artifact(root, checkpoint, 2)


def _node(artifact: Path, index: int | None, rendezvous_port: int, http_port: int, **env) -> subprocess.Popen:
    lws = {} if index is None else {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2",
                                    "LWS_WORKER_INDEX": str(index)}
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("LWS_", "MASTER_"))}
    environ.update(lws, LMC_RENDEZVOUS_PORT=str(rendezvous_port), OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([sys.executable, "-m", "lmc", "runtime", "--model-dir", str(artifact), "--port",
                             str(http_port), "--host", "127.0.0.1"], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _ping(url: str) -> int | None:
    try:
        return httpx.get(url + "/ping", timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_two_nodes_answer_as_hf_generate_and_stop_together(pipeline_artifact):
    checkpoint, artifact = pipeline_artifact
    rendezvous, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    leader = _node(artifact, 0, rendezvous, port)
    worker = None
    try:
        deadline = time.monotonic() + 60
        while _ping(url) is None and time.monotonic() < deadline and leader.poll() is None:
            time.sleep(0.2)
        time.sleep(2.0)  # the leader's stage has had time to load: it still waits for stage 1
        assert _ping(url) == 503, "ready before the second stage joined"
        worker = _node(artifact, 1, rendezvous, free_port())
        deadline = time.monotonic() + 120
        while _ping(url) != 200 and time.monotonic() < deadline and leader.poll() is None:
            time.sleep(0.3)
        assert _ping(url) == 200
        answers = httpx.post(url + "/invocations", timeout=120, json={
            "inputs": PROMPTS, "parameters": {"max_new_tokens": max(NEW_TOKENS), "details": True}})
        assert answers.status_code == 200, answers.text
        got = [[token["id"] for token in answer["details"]["tokens"]] for answer in answers.json()]
        assert got == [hf_greedy(checkpoint, prompt, max(NEW_TOKENS)) for prompt in PROMPTS]
        # Concurrent requests wanting different lengths batch together: rows leave the run as they finish.
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(lambda job: httpx.post(url + "/invocations", timeout=120, json={
                "inputs": job[0], "parameters": {"max_new_tokens": job[1], "details": True}}), zip(PROMPTS, NEW_TOKENS)))
        got = [[token["id"] for token in reply.json()["details"]["tokens"]] for reply in replies]
        assert got == [hf_greedy(checkpoint, prompt, n) for prompt, n in zip(PROMPTS, NEW_TOKENS)]
        # Stage 1 dies: the next request fails (424), /ping says 503, and a new stage 1 brings it back.
        worker.kill()
        worker.wait(10)
        failed = httpx.post(url + "/invocations", timeout=120, json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 4}})
        assert failed.status_code == 424, failed.text
        assert _ping(url) == 503
        worker = _node(artifact, 1, rendezvous, free_port())
        deadline = time.monotonic() + 120
        while _ping(url) != 200 and time.monotonic() < deadline and leader.poll() is None:
            time.sleep(0.3)
        again = httpx.post(url + "/invocations", timeout=120, json={
            "inputs": PROMPTS[0], "parameters": {"max_new_tokens": 4, "details": True}})
        assert [token["id"] for token in again.json()["details"]["tokens"]] == hf_greedy(checkpoint, PROMPTS[0], 4)
        leader.send_signal(signal.SIGTERM)  # drains, then stage 0 tells stage 1 to stop
        assert leader.wait(60) == 0
        assert worker.wait(60) == 0, worker.stderr.read()[-2000:]
    finally:
        for proc in (leader, worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _last_line(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    started = time.monotonic()
    _, stderr = proc.communicate(timeout=timeout_s)
    lines = [line for line in stderr.splitlines() if line.strip()]
    return proc.returncode, lines[-1] if lines else "", time.monotonic() - started


@pytest.mark.parametrize("env, message", [
    ({}, "the plan runs on 2 instances (pipeline parallel degree 2) but LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, "
         "LWS_WORKER_INDEX are not set"),
    ({"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": "1"},
     "LWS_GROUP_SIZE = 3, but the plan's pipeline parallel degree is 2"),
    ({"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2"},
     "LWS_WORKER_INDEX = 2: outside the group of 2"),
])
def test_a_missing_or_inconsistent_rendezvous_is_one_line(pipeline_artifact, env, message):
    _, artifact = pipeline_artifact
    code, line, _ = _last_line(_node(artifact, None, free_port(), free_port(), **env), 60)
    assert code == 1
    assert line == f"lmc: error: {message}" or line.startswith(f"lmc: error: {message}")


def test_an_unreachable_leader_and_missing_stages_time_out_with_one_line(pipeline_artifact):
    """A worker whose leader never answers, and a leader whose worker never comes: each gives up after
    LMC_RENDEZVOUS_TIMEOUT_S with one line and exit 1 (both run at once: two process starts' time)."""
    _, artifact = pipeline_artifact
    worker = _node(artifact, 1, free_port(), free_port(), LMC_RENDEZVOUS_TIMEOUT_S="3")
    leader = _node(artifact, 0, free_port(), free_port(), LMC_RENDEZVOUS_TIMEOUT_S="3")
    code, line, took = _last_line(worker, 90)
    assert code == 1 and took < 60
    assert line.startswith("lmc: error: pipeline stage 1 of 2 (leader 127.0.0.1:")
    assert "cannot reach the leader's store at 127.0.0.1:" in line and "within 3 s" in line
    code, line, took = _last_line(leader, 90)
    assert code == 1 and took < 60
    assert line.startswith("lmc: error: worker group 0 cannot load the model: pipeline stage 0 of 2")
    assert "the other 1 stage(s) did not join within 3 s" in line


def test_djl_serving_is_told_to_use_lmc_runtime(pipeline_artifact):
    from lmc.errors import ArtifactError
    from lmc.runtime.startup import verify_for_rank

    _, artifact = pipeline_artifact
    with pytest.raises(ArtifactError, match=r"planned for 2 instances \(pipeline parallel degree 2\): serve it with "
                                            r"`lmc runtime` on each instance"):
        verify_for_rank(artifact, 0, 1)
