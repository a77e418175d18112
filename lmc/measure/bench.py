"""`lmc bench`'s edges: what to measure (lengths, levels, the plan), serving an artifact for the run,
and the run itself (load generator + memory sampler -> report)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from lmc.errors import ArtifactError, UsageError, short_repr
from lmc.measure.host import host_line, load_average
from lmc.measure.loadgen import BenchError


def default_levels(concurrency: int) -> list[int]:
    """1, 2, 4, ... below `concurrency`, then `concurrency` itself."""
    levels, level = [], 1
    while level < concurrency:
        levels.append(level)
        level *= 2
    return levels + [concurrency]


# The most prompt or output tokens (or timed requests) a level may ask for: past any model's context.
_MAX_TOKENS = 10_000_000


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency {text!r}: expected comma-separated whole numbers, e.g. 1,2,4,8") from None
    if not levels or any(level < 1 or level > 1024 for level in levels):
        raise UsageError(f"--concurrency {text!r}: each level must be 1 to 1024")
    return sorted(set(levels))


def artifact_manifest(path: Path) -> dict[str, Any]:
    """lmc.json of an artifact directory or archive (the runtime verifies the rest when it serves it)."""
    from lmc.manifest import MANIFEST_NAME, read_manifest

    if path.is_dir():
        return read_manifest(path)
    try:
        with tarfile.open(path) as archive:
            member = archive.extractfile(MANIFEST_NAME)
            if member is None:
                raise KeyError(MANIFEST_NAME)
            data = member.read(64 * 2**20)
    except (OSError, tarfile.TarError, KeyError) as exc:
        raise ArtifactError(f"{path}: not an lmc artifact ({exc})") from None
    with tempfile.TemporaryDirectory(prefix="lmc-bench-") as tmp:
        (Path(tmp) / MANIFEST_NAME).write_bytes(data)
        return read_manifest(Path(tmp))


@dataclass
class BenchSetup:
    """What one `lmc bench` run measures."""

    target: str
    is_url: bool
    input_tokens: int
    output_tokens: int
    levels: list[int]
    requests: int | None
    plan: dict[str, Any] | None  # the artifact's plan (None for a URL)
    spec_path: Path | None
    pid: int | None
    timeout_s: float
    startup_timeout_s: float
    memory_device: str | None = None  # "cpu" | "gpu"; None: from the plan
    tokenizer: Path | None = None  # tokenizer.json: lets every token stream (loadgen's logit_bias)

    @classmethod
    def from_args(cls, args) -> "BenchSetup":
        is_url = args.target.startswith(("http://", "https://"))
        plan = workload = None
        if not is_url:
            path = Path(args.target)
            if not path.exists():
                raise UsageError(f"{args.target}: no such artifact (give a model.tar.gz, a built directory, or http://host:port)")
            manifest = artifact_manifest(path)
            plan, workload = manifest["plan"], (manifest["spec"].get("workload") or {})
        elif args.pid is not None and not Path(f"/proc/{args.pid}").exists():
            raise UsageError(f"--pid {args.pid}: no such process")
        if args.spec is not None:
            from lmc.schema import load_spec

            workload = load_spec(args.spec).spec.workload.model_dump()
        workload = workload or {}
        input_tokens = args.input_tokens if args.input_tokens is not None else workload.get("max_input_tokens")
        output_tokens = args.output_tokens if args.output_tokens is not None else workload.get("max_output_tokens")
        if input_tokens is None or output_tokens is None:
            raise UsageError("give --input-tokens and --output-tokens, or --spec (its workload sets them)")
        for flag, value in (("--input-tokens", input_tokens), ("--output-tokens", output_tokens),
                            ("--requests", 1 if args.requests is None else args.requests)):
            if value < 1:
                raise UsageError(f"{flag} {value}: must be at least 1")
            if value > _MAX_TOKENS:  # a prompt of that many words would not fit in memory, nor any model's context
                raise UsageError(f"{flag} {value}: at most {_MAX_TOKENS:,}")
        if output_tokens < 2:
            raise UsageError("--output-tokens must be at least 2 (TPOT is the time between tokens)")
        for flag, value in (("--timeout", args.timeout), ("--startup-timeout", args.startup_timeout)):
            if not (math.isfinite(value) and value > 0):
                raise UsageError(f"{flag} {value}: must be a positive number of seconds")
        for flag, out in (("--json", args.json), ("--plot", args.plot)):
            if out is not None and not (out.parent if str(out.parent) else Path(".")).is_dir():
                raise UsageError(f"{flag} {out}: no such directory {out.parent} (the run's figures would be lost)")
        levels = parse_levels(args.concurrency) if args.concurrency else default_levels(int(workload.get("concurrency") or 1))
        tokenizer = args.tokenizer
        if tokenizer is not None and not tokenizer.is_file():
            raise UsageError(f"--tokenizer {tokenizer}: no such file (give the model's tokenizer.json)")
        return cls(args.target.rstrip("/"), is_url, input_tokens, output_tokens, levels, args.requests, plan,
                   args.spec, args.pid, args.timeout, args.startup_timeout, args.device, tokenizer)

    def requests_for(self, concurrency: int) -> int:
        return self.requests or max(4, 2 * concurrency)

    def device(self) -> str:
        if self.memory_device is not None:
            return self.memory_device
        kind = ((self.plan or {}).get("target") or {}).get("accelerator")
        return "cpu" if kind in (None, "cpu") else "gpu"

    def predictions(self, report: dict[str, Any]) -> dict[str, Any] | None:
        """The spec's plan evaluated at each level of `report` (None without --spec)."""
        if self.spec_path is None:
            return None
        from lmc.measure.compare import compare
        from lmc.pipeline import plan_from_spec
        from lmc.planner.engines import engine_facts
        from lmc.schema import load_spec

        result = plan_from_spec(load_spec(self.spec_path))
        return compare(result.plan, result.model, result.hardware, engine_facts()[result.plan.engine], report)


@dataclass
class Served:
    url: str
    pid: int | None  # whose process tree holds the workers
    tokenizer: Path | None = None  # the served model's tokenizer.json, where known


@contextlib.contextmanager
def open_target(setup: BenchSetup, quiet: bool = False) -> Iterator[Served]:
    """The URL as given, or the artifact served by `lmc runtime` until the block ends."""
    if setup.is_url:
        yield Served(setup.target, setup.pid, setup.tokenizer)
        return
    from lmc.runtime.workers import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="lmc-bench-runtime-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "lmc", "runtime", "serve", setup.target, "--port", str(port), "--host", "127.0.0.1",
               "--request-timeout", str(setup.timeout_s)]
    if not quiet:
        print(f"lmc bench: serving {setup.target} on port {port} (log: {log.name})", file=sys.stderr)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", server, Path(log.name), setup.startup_timeout_s)
        with _artifact_tokenizer(Path(setup.target)) as tokenizer:
            yield Served(f"http://127.0.0.1:{port}", server.pid, setup.tokenizer or tokenizer)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
        if quiet and server.returncode == 0:
            Path(log.name).unlink(missing_ok=True)


@contextlib.contextmanager
def _artifact_tokenizer(path: Path) -> Iterator[Path | None]:
    """The artifact's tokenizer.json (read from the archive into a temporary file), or None."""
    if path.is_dir():
        yield path / "tokenizer.json" if (path / "tokenizer.json").is_file() else None
        return
    with tempfile.TemporaryDirectory(prefix="lmc-bench-") as tmp:
        try:
            with tarfile.open(path) as archive:
                member = archive.extractfile("tokenizer.json")
                if member is None:
                    raise KeyError("tokenizer.json")
                (Path(tmp) / "tokenizer.json").write_bytes(member.read())
        except (OSError, tarfile.TarError, KeyError):
            yield None
            return
        yield Path(tmp) / "tokenizer.json"


def _wait_ready(url: str, server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines()
            raise BenchError(f"lmc runtime exited with {server.returncode} before it was ready: "
                             f"{lines[-1] if lines else 'no output'} (log: {log})")
        try:
            if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise BenchError(f"lmc runtime was not ready after {timeout_s:.0f} s (log: {log})")


async def run_bench(setup: BenchSetup, served: Served, *, lmc_version: str, measured_at: str) -> dict[str, Any]:
    """Every level in turn: prompts sized once, then each level's warm-up and timed requests."""
    import httpx
    from tqdm import tqdm

    from lmc.measure.loadgen import _completion_body, build_prompt, make_client, run_level, served_model, word_token
    from lmc.measure.procmem import PeakMemory
    from lmc.measure.report import bench_report, level_report

    sampler = PeakMemory(served.pid, setup.device()) if served.pid is not None else None
    host_before = host_line()
    async with make_client(setup.timeout_s, max(setup.levels)) as client:
        try:
            model = await served_model(client, served.url)
            prompt, word = await build_prompt(client, served.url, model, setup.input_tokens)
        except httpx.TransportError as exc:  # nothing listens there, or it went away: before any level ran
            raise BenchError(f"{served.url}: cannot reach the server ({type(exc).__name__}: {exc})") from None
        bias = word_token(served.tokenizer, word) if served.tokenizer is not None else None
        body = _completion_body(prompt, setup.output_tokens, model, stream=True, bias_token=bias)
        levels = []
        with contextlib.ExitStack() as stack:
            if sampler is not None:
                stack.enter_context(sampler)
            bar = stack.enter_context(tqdm(setup.levels, desc="lmc bench", unit="level", disable=None, file=sys.stderr))
            for concurrency in bar:
                bar.set_postfix_str(f"concurrency {concurrency}")
                if sampler is not None:
                    sampler.mark()
                samples, wall = await run_level(client, served.url, body, concurrency, setup.requests_for(concurrency))
                peak = sampler.window_peak() if sampler is not None else None
                levels.append(level_report(concurrency, samples, wall, peak, setup.output_tokens))
    workers = sampler.overall() if sampler is not None else {}
    host = f"{host_before}; after: load average {load_average()}"
    report = bench_report(lmc_version=lmc_version, target=setup.target, plan=setup.plan, measured_at=measured_at,
                          host=host, input_tokens=setup.input_tokens, output_tokens=setup.output_tokens, levels=levels,
                          memory_source=sampler.source if sampler is not None else None, workers=workers)
    report["workload"]["logit_bias_token"] = bias
    return report


def load_report(path: Path) -> dict[str, Any]:
    """A bench report written by `lmc bench --json`; a file that is not one is a one-line error."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # FileNotFoundError too: a bad input file, as a missing spec is
        raise ArtifactError(f"--compare {path}: not a bench report ({exc})") from None
    if not isinstance(report, dict) or report.get("kind") != "lmc-bench" or not isinstance(report.get("levels"), list) \
            or not isinstance(report.get("workload"), dict):
        raise ArtifactError(f"--compare {path}: not a bench report (`lmc bench --json` writes one)")
    from lmc.measure.report import FORMAT_VERSION

    if report.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"--compare {path}: bench report format {report.get('format_version')!r}, expected {FORMAT_VERSION}")
    problem = _report_problem(report)
    if problem is not None:
        raise ArtifactError(f"--compare {path}: not a bench report lmc wrote: {problem}")
    return report


# The most concurrent requests a level may state: far past any load `lmc bench` sends, short of the sizes that
# overflow the serving model's arithmetic.
_MAX_CONCURRENCY = 1_000_000


def _report_problem(report: dict[str, Any]) -> str | None:
    """What makes a report's figures unusable for --compare (a hand-edited or damaged file), or None: the
    workload's token counts, each level's concurrency, and each figure as `lmc bench` writes it (a number, or
    percentiles of numbers; None where it measured none)."""
    from lmc.measure.compare import FIGURES

    def count(value: Any, top: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= top

    def number(value: Any) -> bool:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                 and 0 <= value < float("inf"))

    workload = report["workload"]
    for key in ("input_tokens", "output_tokens"):
        if not count(workload.get(key), _MAX_TOKENS):
            return f"workload.{key} must be a positive integer, not {short_repr(workload.get(key))}"
    sha = report.get("plan_sha256")
    if sha is not None and not isinstance(sha, str):
        return f"plan_sha256 must be a string, not {short_repr(sha)}"
    for index, level in enumerate(report["levels"]):
        if not isinstance(level, dict):
            return f"levels[{index}] must be an object, not {short_repr(level)}"
        if not count(level.get("concurrency"), _MAX_CONCURRENCY):
            return f"levels[{index}].concurrency must be a whole number from 1 to {_MAX_CONCURRENCY}, not " \
                   f"{short_repr(level.get('concurrency'))}"
        for key, _, _ in FIGURES:
            value = level.get(key)
            values = value.items() if isinstance(value, dict) else [("", value)]
            for stat, figure in values:
                if not number(figure):
                    where = f"levels[{index}].{key}" + (f".{stat}" if stat else "")
                    return f"{where} must be a finite number of at least 0, not {short_repr(figure)}"
    return None
