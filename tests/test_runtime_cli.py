"""`python -m lmc runtime` as a process: refusal of an altered artifact, SIGTERM draining, archives."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from runtime_fakes import expected_text, fake_plan, free_port, wait_in_flight, write_archive, write_artifact

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def _start(args, env=None, new_session=False):
    return subprocess.Popen([sys.executable, "-m", "lmc", "runtime", *args], cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=new_session)


@contextlib.contextmanager
def _session(args, env=None):
    """`lmc runtime` in a process group of its own, killed whole on the way out: a test that fails leaves
    no rank, fork server or resource tracker behind."""
    proc = _start(args, env, new_session=True)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _forked(root: Path) -> list[int]:
    """The ranks forked so far: their LMC_AUDIT_OPENS files (`root`/audit.g<group>r<rank>.<pid>)."""
    return sorted(int(path.name.rsplit(".", 1)[1]) for path in root.glob("audit.*"))


def _wait_forked(root: Path, proc, count: int, timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(_forked(root)) < count:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    return _forked(root)


def _wait_ping(url, proc, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            if httpx.get(url + "/ping").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("/ping never became 200")


def test_an_altered_shard_stops_start_up_with_exit_1_naming_it(tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2), {"record_dir": str(record)})
    shard = model / "shards/tp2/rank0.safetensors"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = _start(["--model-dir", str(model), "--port", str(free_port())])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("lmc: error: ") and "shards/tp2/rank0.safetensors: altered" in lines[0]
    assert list(record.iterdir()) == []  # no worker got as far as loading the engine


def _slow_to_verify(model: Path) -> Path:
    """`model` with a 12 GiB sparse file in its manifest (a wrong sha256: the tests signal before the
    check ends): a hash check of seconds to a minute, without the disk space."""
    import json

    from lmc.manifest import MANIFEST_NAME, build_manifest, manifest_bytes

    big = model / "big.bin"
    with open(big, "wb") as handle:
        handle.truncate(12 * 1024**3)
    if big.stat().st_blocks * 512 > 1024**2:
        pytest.skip("this filesystem has no sparse files")
    manifest = json.loads((model / MANIFEST_NAME).read_text())
    files = {rel: (entry["size"], entry["sha256"]) for rel, entry in manifest["files"].items()}
    files["big.bin"] = (big.stat().st_size, "0" * 64)
    (model / MANIFEST_NAME).write_bytes(manifest_bytes(build_manifest("0.1.0", manifest["spec"], manifest["plan"], files)))
    return model


def _assert_group_ends(pgid: int, timeout_s: float = 15.0) -> None:
    """Every process of the process group `pgid` exits (zombies count as gone) within `timeout_s`."""
    def live() -> list[int]:
        listed = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in listed.split() if _alive(int(pid))]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and live():
        time.sleep(0.1)
    assert not live(), subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(pgid)], capture_output=True, text=True).stdout


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_signal_while_the_hashes_are_checked_leaves_no_worker_behind(tmp_path, sig):
    """The ranks wait at the gate while the front end checks a 12 GiB (sparse) file. SIGTERM: start-up
    unwinds, the check stops at its next chunk, the ranks are stopped, exit 0. SIGKILL: the ranks see
    their lifeline close and exit by themselves. Either way no process of the runtime is left."""
    model = _slow_to_verify(write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2)))
    with _session(["--model-dir", str(model), "--port", str(free_port())],
                  env={"LMC_AUDIT_OPENS": str(tmp_path / "audit")}) as proc:
        ranks = _wait_forked(tmp_path, proc, 2)
        assert len(ranks) == 2 and all(_alive(pid) for pid in ranks)  # both forked, waiting at the gate
        os.kill(proc.pid, sig)
        code = proc.wait(30)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), proc.stderr.read()[-2000:]
        if sig == signal.SIGTERM:
            assert "SIGTERM during start-up: stopped before serving" in proc.stderr.read()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(pid) for pid in ranks):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in ranks)
        _assert_group_ends(proc.pid)  # the fork server and the resource tracker follow


def test_sigterm_while_the_fork_server_still_imports_stops_everything(tmp_path):
    """SIGTERM before any rank exists (the fork server is importing torch, the supervisor waits in the
    fork): the ranks started after the stop exit at once, none loads the model, nothing is left."""
    record = tmp_path / "record"
    record.mkdir()
    model = _slow_to_verify(write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2), {"record_dir": str(record)}))
    with _session(["--model-dir", str(model), "--port", str(free_port())],
                  env={"LMC_AUDIT_OPENS": str(tmp_path / "audit")}) as proc:
        time.sleep(0.5)
        assert not _forked(tmp_path), "too late: the ranks are already forked"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()[-2000:]
        assert "SIGTERM during start-up: stopped before serving" in proc.stderr.read()
        _assert_group_ends(proc.pid)
        assert not list(record.glob("rank*.pid"))  # no rank loaded the model


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _ignores_sigterm(pid: int) -> bool:
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def test_when_the_fork_server_dies_the_old_ranks_go_and_its_successor_ignores_sigterm(tmp_path):
    """Killing the fork server makes its ranks look dead to the front end while they still run: the
    group is restarted, and the old ranks, still loading, must not load on beside the new ones (their
    lifeline closes). The fork server multiprocessing starts again must ignore SIGTERM like the first,
    so a SIGTERM to the whole process group still drains and exits 0."""
    record = tmp_path / "record"
    record.mkdir()
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2),
                           {"record_dir": str(record), "load_delay_s": 4.0})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _session(["--model-dir", str(model), "--port", str(port), "--host", "127.0.0.1"],
                  env={"LMC_AUDIT_OPENS": str(tmp_path / "audit")}) as proc:
        old = _wait_forked(tmp_path, proc, 2)
        server = {_ppid(pid) for pid in old}
        assert len(old) == 2 and len(server) == 1 and server != {proc.pid}
        server = server.pop()
        assert _ignores_sigterm(server)
        os.kill(server, signal.SIGKILL)  # while the ranks load (4 s)
        killed = time.monotonic()
        while time.monotonic() - killed < 2.5 and any(_alive(pid) for pid in old):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in old)  # gone long before their load would have ended
        _wait_ping(url, proc)
        new = [pid for pid in _forked(tmp_path) if pid not in old]
        successor = {_ppid(pid) for pid in new}
        assert len(new) == 2 and len(successor) == 1 and successor != {server}
        assert _ignores_sigterm(successor.pop())
        assert sorted(int(path.read_text()) for path in record.glob("rank*.pid")) == sorted(new)  # only they loaded
        reply = httpx.post(url + "/invocations", json={"inputs": "after", "parameters": {"max_new_tokens": 3}}, timeout=30)
        assert reply.json() == {"generated_text": expected_text("after", 3)}
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0


def _wait_draining(url: str, timeout_s: float = 10.0) -> None:
    """Until /ping answers 503: the front end has taken the signal and drains."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and httpx.get(url + "/ping").status_code != 503:
        time.sleep(0.02)
    assert httpx.get(url + "/ping").status_code == 503


@pytest.mark.parametrize("whole_group", [False, True], ids=["to-the-front-end", "to-the-process-group"])
def test_sigterm_lets_in_flight_requests_finish_then_exits_0(tmp_path, whole_group):
    model = write_artifact(tmp_path / "m", fake_plan(batch_size=2, max_batch_delay_ms=0), {"step_delay_s": 0.05})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _session(["--model-dir", str(model), "--port", str(port), "--host", "127.0.0.1"]) as proc:
        _wait_ping(url, proc)
        replies = {}

        def ask(i):
            replies[i] = httpx.post(url + "/invocations", json={"inputs": f"in flight {i}",
                                                               "parameters": {"max_new_tokens": 20}}, timeout=30)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        wait_in_flight(url, 4)  # all 4 admitted (the first batch generating, the second waiting)
        if whole_group:  # as systemd or a shell would: the workers get it too
            os.killpg(proc.pid, signal.SIGTERM)
        else:  # as docker stop does: PID 1 only
            proc.send_signal(signal.SIGTERM)
        _wait_draining(url)
        late = httpx.post(url + "/invocations", json={"inputs": "too late"})
        assert late.status_code == 503 and "shutting down" in late.json()["error"]
        for thread in threads:
            thread.join(30)
        assert {i: r.status_code for i, r in replies.items()} == {0: 200, 1: 200, 2: 200, 3: 200}
        assert all(r.json() == {"generated_text": expected_text(f"in flight {i}", 20)} for i, r in replies.items())
        assert proc.wait(30) == 0


def test_a_second_ctrl_c_cuts_the_drain_short_with_exit_130(tmp_path):
    """The first SIGINT drains like SIGTERM; a second one stops now, as uvicorn's does: the requests still
    generating (20 s of it) are answered 503 at once (a stream: its error line), every process goes, the
    log has no traceback, and the exit status says so."""
    model = write_artifact(tmp_path / "m", fake_plan(), {"step_delay_s": 0.5})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _session(["--model-dir", str(model), "--port", str(port), "--host", "127.0.0.1"]) as proc:
        _wait_ping(url, proc)
        replies = {}

        def ask(stream):
            body = {"inputs": "slow", "parameters": {"max_new_tokens": 40}, "stream": stream}
            try:
                reply = httpx.post(url + "/invocations", json=body, timeout=60)
                replies[stream] = (reply.status_code, reply.text.splitlines()[-1])
            except httpx.TransportError as exc:
                replies[stream] = type(exc).__name__

        threads = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
        for thread in threads:
            thread.start()
        wait_in_flight(url, 2)
        proc.send_signal(signal.SIGINT)
        _wait_draining(url)
        assert proc.poll() is None
        cut = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 130
        for thread in threads:
            thread.join(15)
        assert time.monotonic() - cut < 15  # not after their 20 s
        message = "the server stopped (second interrupt) before this request finished"
        assert replies[False] == (503, json.dumps({"error": message, "code": 503}, separators=(",", ":"))), replies
        assert replies[True][0] == 200 and json.loads(replies[True][1]) == {"error": message, "code": 503}, replies
        log = proc.stderr.read()
        assert "second interrupt: stopping now; 2 request(s) in flight are answered 503" in log
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
        _assert_group_ends(proc.pid)


def test_serves_an_archive_with_the_sagemaker_serve_word_and_port(tmp_path):
    model = write_artifact(tmp_path / "m", fake_plan())
    archive = write_archive(model, tmp_path / "model.tar.gz")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    port = free_port()
    proc = _start(["serve", str(archive)], env={"SAGEMAKER_BIND_TO_PORT": str(port), "LMC_EXTRACT_DIR": str(scratch)})
    try:
        _wait_ping(f"http://127.0.0.1:{port}", proc)
        reply = httpx.post(f"http://127.0.0.1:{port}/invocations", json={"inputs": "from the archive"})
        assert reply.json() == {"generated_text": expected_text("from the archive", 32)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert list(scratch.iterdir()) == []  # the extracted copy is removed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "rank1"])
def test_a_model_that_cannot_load_stops_start_up_with_one_line(tmp_path, rank):
    """A deterministic load failure (an LmcError such as a missing SDK) is not retried forever while
    /ping says 503: the runtime exits with the error's code and says why in its last line."""
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2),
                           {"load_error": "the neuronx engine needs the Neuron SDK", "load_error_rank": rank})
    started = time.monotonic()
    proc = _start(["--model-dir", str(model), "--port", str(free_port())])
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err[-2000:]
    assert time.monotonic() - started < 60
    last = err.strip().splitlines()[-1]
    assert last.startswith("lmc: error: worker group 0"), err[-2000:]
    if rank == 0:
        assert last == "lmc: error: worker group 0 cannot load the model: the neuronx engine needs the Neuron SDK"
    else:
        assert "rank 1 cannot load the model" in last
        assert "rank 1 cannot load the model: the neuronx engine needs the Neuron SDK" in err


@pytest.mark.parametrize("args, env, message", [
    (["--request-timeout", "0"], {}, "--request-timeout = 0.0: must be a positive number"),
    (["--max-body-bytes", "-5"], {}, "--max-body-bytes = -5: must be a positive number"),
    ([], {"LMC_REQUEST_TIMEOUT_S": "nan"}, "LMC_REQUEST_TIMEOUT_S = nan: must be a positive number"),
    ([], {"LMC_MAX_BODY_BYTES": "lots"}, "LMC_MAX_BODY_BYTES = 'lots': not a number"),
    ([], {"LMC_GENERATION_CONFIG": "vllm"}, "LMC_GENERATION_CONFIG = 'vllm': must be auto or none"),
    # Past 65535 the hf front end served on another port than the one asked (found by fuzzing the flags).
    (["--port", "70000"], {}, "--port = 70000: not a TCP port number (0-65535; 0: any free port)"),
])
def test_bad_timeouts_and_limits_are_usage_errors_before_anything_starts(tmp_path, monkeypatch, args, env, message):
    model = write_artifact(tmp_path / "m", fake_plan())
    for name in ("LMC_REQUEST_TIMEOUT_S", "LMC_MAX_BODY_BYTES", "LMC_GENERATION_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    proc = _start(["--model-dir", str(model), "--port", str(free_port()), *args], env=env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"lmc: error: {message}"], err


def test_a_port_in_use_is_one_line_before_any_rank_loads(tmp_path):
    """The listening socket is bound before the model loads: an address in use (or a host that does not
    resolve) was uvicorn's own error, exit 3 (lmc's "no feasible plan"), after every rank had loaded."""
    import socket

    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _start(["--model-dir", str(model), "--host", "127.0.0.1", "--port", str(port)],
                      env={"LMC_AUDIT_OPENS": str(tmp_path)})
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == f"lmc: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert _forked(tmp_path) == [] and "loaded rank" not in err  # no rank started


@pytest.mark.parametrize("args, env, temperature", [
    ([], {}, 0.6),
    (["--generation-config", "none"], {"LMC_GENERATION_CONFIG": "auto"}, 1.0),
    ([], {"LMC_GENERATION_CONFIG": "none"}, 1.0),
], ids=["default-auto", "flag-none-beats-env", "env-none"])
def test_generation_config_mode_decides_the_openai_defaults(tmp_path, monkeypatch, args, env, temperature):
    import json

    monkeypatch.delenv("LMC_GENERATION_CONFIG", raising=False)
    record = tmp_path / "record"
    record.mkdir()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    model = write_artifact(tmp_path / "m", fake_plan(), {"record_dir": str(record)})
    port = free_port()
    proc = _start(["--model-dir", str(model), "--port", str(port), *args], env=env)
    try:
        _wait_ping(f"http://127.0.0.1:{port}", proc)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "a b", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        [batch] = [json.loads(line) for line in (record / "batches.jsonl").read_text().splitlines()]
        assert batch["params"][0]["temperature"] == temperature
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_the_runtimes_parser_leaves_the_planner_and_emitters_unimported():
    """`lmc runtime` parses its flags without importing the other subcommands' modules (the planner and the
    emitters took 0.4 s here): its SIGTERM handler is in place before a container stopped at once is signalled,
    where before the signal killed it (exit -15, test above). `lmc --help` still lists every subcommand."""
    code = ("import sys; from lmc.cli.main import build_parser; build_parser('runtime').parse_args(['runtime', "
            "'--model-dir', '/x']); print(sorted(m for m in sys.modules if m.startswith(('lmc.planner', "
            "'lmc.emitters', 'pydantic'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    listed = subprocess.run([sys.executable, "-m", "lmc", "--help"], capture_output=True, text=True).stdout
    assert all(name in listed for name in ("plan", "build", "deploy", "runtime", "calibrate", "bench"))
