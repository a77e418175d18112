"""A deterministic fake engine and helpers that build small artifacts around it, for the runtime
tests. The artifact's model.py imports this module from the tests directory."""

from __future__ import annotations

import functools
import json
import os
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from lmc.manifest import BINDING_FILE, MANIFEST_NAME, build_manifest, digest_json, manifest_bytes, sha256_file
from lmc.runtime.engines.base import GenerationRequest, GenerationResult
from lmc.runtime.workers import free_port
from lmc.testing.checkpoints import tokenizer_json

TESTS_DIR = Path(__file__).resolve().parent
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@functools.cache
def artifact_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json())


def prompt_tokens(text: str) -> int:
    """What the runtime must count for `text`: the artifact's tokenizer (write_artifact ships the tiny
    checkpoints' byte-level BPE), not words: "red green blue" is 10 tokens."""
    return len(artifact_tokenizer().encode(text).ids)


def expected_text(prompt: str, max_new_tokens: int) -> str:
    """What FakeEngine answers: the prompt's words reversed, cycled, one word per token."""
    words = list(reversed(prompt.split())) or ["_"]
    return "".join(f" {words[i % len(words)]}" for i in range(max_new_tokens))


class FakeEngine:
    """Knobs: `step_delay_s` per generated token (slow), `load_delay_s`, `record_dir` (batches.jsonl, one
    line per batch: rank, size and each request's sampling parameters; finished.jsonl, one line per
    request: rank, id, generated_tokens, finish_reason, time; pid files per rank), `load_error` / `load_error_rank` (load raises an
    LmcError), `load_crash_rank` (load raises a plain error; with `load_crashes`, its first n loads only). Prompts containing RAISE make generate raise;
    RAISE@N only when that request's seed is N (one of n choices). Rows the cancel probe names stop
    before their next step, finish_reason "cancelled"."""

    every_rank_answers = False  # every rank answers alike anyway

    def __init__(self, step_delay_s: float = 0.0, load_delay_s: float = 0.0, record_dir: str | None = None,
                 load_error: str | None = None, load_error_rank: int | None = None, load_crash_rank: int | None = None,
                 load_crashes: int | None = None):
        self.step_delay_s = step_delay_s
        self.load_delay_s = load_delay_s
        self.record_dir = Path(record_dir) if record_dir else None
        self.load_error = load_error  # raise MissingDependencyError(load_error) in load (on load_error_rank, or all)
        self.load_error_rank = load_error_rank
        self.load_crash_rank = load_crash_rank  # raise a plain RuntimeError in load on this rank
        self.load_crashes = load_crashes  # ... only its first n loads (counted in record_dir), else every one
        self.rank = -1

    def load(self, model_dir: Path, rank: int, world_size: int) -> None:
        self.rank = rank
        time.sleep(self.load_delay_s)
        if self.load_error is not None and self.load_error_rank in (None, rank):
            from lmc.errors import MissingDependencyError

            raise MissingDependencyError(self.load_error)
        if self.load_crash_rank == rank:
            if self.load_crashes is None:
                raise RuntimeError("a load failure")
            counter = self.record_dir / f"load_crashes.rank{rank}"
            crashed = int(counter.read_text()) if counter.exists() else 0
            if crashed < self.load_crashes:
                counter.write_text(str(crashed + 1))
                raise RuntimeError("a transient load failure")
        if self.record_dir is not None:
            (self.record_dir / f"rank{rank}.{os.getpid()}.pid").write_text(str(os.getpid()))

    def count_tokens(self, text: str) -> int:
        return prompt_tokens(text)

    def generate(self, batch: list[GenerationRequest], on_token=None, cancel_probe=None) -> list[GenerationResult]:
        if self.record_dir is not None:
            with open(self.record_dir / "batches.jsonl", "a") as handle:
                params = [{key: getattr(r.params, key) for key in ("max_new_tokens", "do_sample", "temperature", "top_p",
                                                                    "top_k", "repetition_penalty")} for r in batch]
                handle.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "size": len(batch), "params": params}) + "\n")
        for request in batch:
            words = [word for word in request.prompt.split() if word.startswith("RAISE")]
            if any(word == "RAISE" or word == f"RAISE@{request.params.seed}" for word in words):
                raise RuntimeError("fake failure requested by the prompt")
        texts = {r.id: expected_text(r.prompt, r.params.max_new_tokens) for r in batch}
        made = {r.id: 0 for r in batch}  # tokens generated so far; rows the cancel probe names stop
        stopped: set[str] = set()
        steps = max(r.params.max_new_tokens for r in batch)
        for step in range(steps):
            if cancel_probe is not None:
                stopped.update(r.id for r in batch if r.id in cancel_probe())
            if len(stopped) == len(batch):
                break
            time.sleep(self.step_delay_s)
            for request in batch:
                if step < request.params.max_new_tokens and request.id not in stopped:
                    made[request.id] += 1
                    if on_token is not None:
                        on_token(request.id, " " + texts[request.id].split(" ")[step + 1])
        results = [GenerationResult(id=r.id, text="".join(f" {w}" for w in texts[r.id].split()[:made[r.id]]),
                                    prompt_tokens=self.count_tokens(r.prompt), generated_tokens=made[r.id],
                                    finish_reason="cancelled" if r.id in stopped else "length") for r in batch]
        if self.record_dir is not None:
            with open(self.record_dir / "finished.jsonl", "a") as handle:
                for result in results:
                    handle.write(json.dumps({"rank": self.rank, "id": result.id, "generated_tokens": result.generated_tokens,
                                             "finish_reason": result.finish_reason, "at": time.time()}) + "\n")
        return results


def fake_plan(**overrides: Any) -> dict[str, Any]:
    plan = {"lmc_version": "0.1.0", "model": {"id": "fake/tiny"},
            "target": {"instance": "local", "accelerator": "cpu", "devices": 1, "instances": 1},
            "engine": "hf", "dtype": "fp32", "tensor_parallel_degree": 1, "replicas": 1,
            "batch_size": 4, "max_batch_delay_ms": 20, "job_queue_size": 16, "max_sequence_length": 64}
    plan.update(overrides)
    return plan


def write_artifact(root: Path, plan: dict[str, Any], engine_kwargs: dict[str, Any] | None = None,
                   chat_template: bool = True, spec: dict[str, Any] | None = None, tokenizer: bool = True) -> Path:
    """A model dir whose model.py builds FakeEngine(**engine_kwargs), with a real tokenizer.json (unless
    `tokenizer` is False) and a verified lmc.json."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(TESTS_DIR)!r})\n"
        "from runtime_fakes import FakeEngine\n\n\n"
        "def create_engine():\n"
        f"    return FakeEngine(**{dict(engine_kwargs or {})!r})\n")
    (root / "config.json").write_text(json.dumps({"model_type": "fake"}))
    if tokenizer:  # a real tokenizer counts the prompts
        (root / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    (root / "requirements.txt").write_text("lmc\n")
    shards = root / "shards" / f"tp{plan['tensor_parallel_degree']}"
    shards.mkdir(parents=True, exist_ok=True)
    for rank in range(plan["tensor_parallel_degree"]):
        (shards / f"rank{rank}.safetensors").write_bytes(bytes(range(256)) * 4)
    if chat_template:
        (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "</s>"}))
    # The header lines that bind lmc.json's spec and plan to a hashed file (manifest.check_binding).
    (root / BINDING_FILE).write_text(f"# spec sha256 {digest_json(spec or {})}\n"
                                     f"# plan sha256 {digest_json(dict(plan, plan_sha256=''))}\nengine=Python\n")
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST_NAME and "__pycache__" not in path.parts:
            files[path.relative_to(root).as_posix()] = (path.stat().st_size, sha256_file(path))
    (root / MANIFEST_NAME).write_bytes(manifest_bytes(build_manifest("0.1.0", spec or {}, plan, files)))
    return root


def write_archive(model: Path, archive: Path) -> Path:
    """`model` (a write_artifact dir) as a model.tar.gz, members in sorted order."""
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(model.rglob("*")):
            tar.add(path, arcname=path.relative_to(model).as_posix(), recursive=False)
    return archive


def wait_in_flight(url: str, count: int, timeout_s: float = 30.0) -> None:
    """Until the server at `url` counts `count` requests in flight in /metrics (each one admitted)."""
    import httpx

    line = f"lmc_requests_in_flight {count}.0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and line not in httpx.get(url + "/metrics").text:
        time.sleep(0.02)
    assert line in httpx.get(url + "/metrics").text


class ServerThread:
    """`lmc runtime`'s server for a Runtime, in a thread of the test process."""

    def __init__(self, runtime, drain_timeout_s: float | None = None):
        from lmc.runtime.server import make_server

        self.runtime = runtime
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(runtime, "127.0.0.1", self.port, drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if httpx.get(f"{self.url}/ping").status_code == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"/ping not 200 within {timeout_s}s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
