"""vLLM server parity: `lmc runtime` against `vllm serve`, same artifact, same engine arguments, measured by
vLLM's own benchmark client (`vllm bench serve`). The yardstick for issue 22 (replace lmc's front end for
vLLM plans by vLLM's OpenAI server).

For each model (--models): a random-weight Llama is made with lmc.testing.checkpoints.make_checkpoint and
`lmc build --format dir`ed from a spec (`[target] instance = "local"` with specs/profiles/cpu-2core.toml,
4 GiB per device, 64 tokens in and out at concurrency 16, `[pin] engine = "vllm"`, fp32, and a TTFT goal of
22 s, from which the plan sets vLLM's admission bound: max_num_queued_reqs, the same for both servers; 22 s keeps
it above the 128 concurrent requests of the heavier level for both models, 926 and 136 on 2026-11-28, so that
neither server refuses requests there and the level compares them; at 15 s the 512 model's bound came to 97 and
both servers refused 606 of 800 alike):
  tiny  hidden 128, intermediate 256, 2 layers, 4 heads of 32 (2 KV heads)   ~1.5 MB
  512   hidden 512, intermediate 1376, 8 layers, 8 heads of 64 (4 KV heads)  ~90 MB
The artifact is served twice, each in its own process group on a free 127.0.0.1 port:
  lmc   `python -m lmc runtime serve ARTIFACT --host 127.0.0.1 --port P --request-timeout 600`
  vllm  `python bench/vllm_cli.py serve --host 127.0.0.1 --port P FLAGS`, FLAGS being the command line lmc
        gives vLLM's server for the artifact (lmc.runtime.vllm_backend.serve_arguments: the same list `lmc
        runtime` parses with vLLM's parser, without lmc's middleware), with the environment from
        engine_environment(plan) (VLLM_CPU_KVCACHE_SPACE, ...).
The engine configuration each server's vLLM logs ("Initializing a V1 LLM engine ... with config: ...") is
compared, and any difference is printed.

Both servers of a model stay up; the one not being measured is stopped with SIGSTOP (its whole process
group: front end, engine core, workers) so that it takes no CPU, and SIGCONT'd for its turn. Runs come
in pairs (--runs pairs per concurrency), each pair with its own prompts (seed), the same for both servers,
in the order lmc, vllm for even pairs and vllm, lmc for odd ones (A B B A: a drift of the host's speed,
or a cost of going first, falls on both servers alike instead of on lmc, which went first in every pair
until 2026-11-26). Each record keeps its position in the pair. Each run is one `vllm bench serve
--backend vllm --endpoint /v1/completions --dataset-name random --random-input-len 48
--random-output-len 64 --ignore-eos --temperature 0 --num-prompts N --max-concurrency C --num-warmups C
--save-result --save-detailed`; its JSON is read back.
The machine's load (os.getloadavg) is recorded before and after each run.

One table: per model, concurrency and server, output tokens/s over the runs (total tokens / total
duration; min-max of the runs), TTFT and TPOT p50/p99 over all the runs' requests, failed requests, the
1-minute load, and per run the TTFT p99 the server's vLLM counted itself (the bucket of its Prometheus
histogram, scraped before and after the run: vLLM's clock starts once the API server's handler has the
request, so a client TTFT far above it was spent before that); then lmc/vllm ratios against the issue's
targets: throughput >= 0.95x, TTFT p99 <= 1.1x, no failed request at concurrency 16. Figures are
reported, not asserted: exit 0 unless something broke (a build, a server start, a client run). --json OUT
writes everything, the raw vLLM results included.

Usage:
  python bench/vllm_server_parity.py [--models tiny,512] [--concurrency 16,128] [--runs 2]
      [--requests-16 320] [--requests-128 400] [--requests C:N,...] [--json OUT] [--keep DIR]
  smoke: python bench/vllm_server_parity.py --models tiny --concurrency 4 --runs 1 --requests 4:8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
VLLM_CLI = Path(__file__).resolve().parent / "vllm_cli.py"

MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256),  # 2 layers, 4 heads of 32, 2 KV heads
    "512": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
}
SERVERS = ("lmc", "vllm")
TARGET_THROUGHPUT = 0.95  # lmc / vllm output tokens/s, at least
TARGET_TTFT_P99 = 1.1  # lmc / vllm TTFT p99, at most
NO_FAILURES_AT = 16  # concurrency at which no request may fail

SPEC = """\
[model]
id = "bench/llama-{name}"
path = "{path}"

[target]
instance = "local"
profile = "{profile}"

[budget]
memory_per_device = "4GiB"

[goal]
ttft_ms = 22000

[workload]
max_input_tokens = 64
max_output_tokens = 64
concurrency = 16

[pin]
engine = "vllm"
dtype = "fp32"
"""

class BenchError(Exception):
    """Something broke (not a figure that missed its target): exit 1."""


# ---------------------------------------------------------------- artifacts and engine arguments

def build(root: Path, name: str) -> Path:
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", root / f"ckpt-{name}", **MODELS[name])
    spec = root / f"spec-{name}.toml"
    spec.write_text(SPEC.format(name=name, path=checkpoint.as_posix(),
                                profile=(REPO / "specs" / "profiles" / "cpu-2core.toml").as_posix()))
    out = root / f"artifact-{name}"
    log = root / f"build-{name}.log"
    with open(log, "w") as handle:
        done = subprocess.run([sys.executable, "-m", "lmc", "build", str(spec), "--format", "dir", "-o", str(out)],
                              stdout=handle, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO)))
    if done.returncode != 0:
        raise BenchError(f"lmc build of {name} failed ({done.returncode}):\n{log.read_text()[-3000:]}")
    return out


def _split_top(text: str) -> list[str]:
    """`a=1, b=X(c=2, d=3), e={...}` -> its top-level comma-separated items."""
    items, depth, start, quote = [], 0, 0, None
    for i, char in enumerate(text):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([{<":
            depth += 1
        elif char in ")]}>":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine \(([^)]*)\) with config: (.*)$")
KV_CACHE_LINE = re.compile(r"(CPU KV cache size: .*|GPU KV cache size: .*|Maximum concurrency for .*)$")


def engine_config(log_path: Path) -> dict[str, Any]:
    """The engine configuration vLLM logged in this server's log, item by item, and its KV cache line."""
    config, kv = None, None
    for line in log_path.read_text(errors="replace").splitlines():
        match = ENGINE_CONFIG.search(line)
        if match and config is None:
            config = {"version": match.group(1), "items": _split_top(match.group(2))}
        kv_match = KV_CACHE_LINE.search(line)
        if kv_match and kv is None:
            kv = kv_match.group(1).strip()
    return {"config": config, "kv_cache": kv}


def config_differences(lmc: dict[str, Any], vllm: dict[str, Any]) -> list[str]:
    if not lmc["config"] or not vllm["config"]:
        return ["engine configuration not found in " + " and ".join(
            name for name, found in (("lmc's log", lmc), ("vllm serve's log", vllm)) if not found["config"])]

    def keyed(items):
        return {item.split("=", 1)[0]: item for item in items}

    a, b = keyed(lmc["config"]["items"]), keyed(vllm["config"]["items"])
    out = [f"lmc: {a.get(key, '(absent)')}  |  vllm serve: {b.get(key, '(absent)')}"
           for key in list(a) + [k for k in b if k not in a] if a.get(key) != b.get(key)]
    if lmc["kv_cache"] != vllm["kv_cache"]:
        out.append(f"KV cache: lmc: {lmc['kv_cache']}  |  vllm serve: {vllm['kv_cache']}")
    return out


# ---------------------------------------------------------------- servers

def pair_order(run: int) -> tuple[str, ...]:
    """The servers' order in pair `run`: lmc first in even pairs, vllm first in odd ones (A B B A)."""
    return SERVERS if run % 2 == 0 else tuple(reversed(SERVERS))


def free_port() -> int:
    from lmc.runtime.workers import free_port as lmc_free_port

    return lmc_free_port()


class Server:
    """A server in its own process group (session), its output in `log_path`."""

    def __init__(self, kind: str, argv: list[str], env: dict[str, str], port: int, ready_path: str, log_path: Path):
        self.kind, self.argv, self.env, self.port, self.ready_path = kind, argv, env, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self.ready_s: float | None = None
        self.returncode: int | None = None

    def start(self, timeout: float) -> None:
        import httpx

        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True, cwd=str(self.log_path.parent))
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.kind} server exited {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    self.ready_s = time.monotonic() - started
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise BenchError(f"{self.kind} server not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def pause(self) -> None:
        """SIGSTOP the whole process group: no CPU taken while the other server is measured."""
        if self.alive() and not self.paused:
            self._signal_group(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        import httpx

        if self.proc is None:
            return
        if self.paused:
            self._signal_group(signal.SIGCONT)
            self.paused = False
        if not self.alive():
            raise BenchError(f"{self.kind} server has exited ({self.proc.returncode}):\n{self.tail()}")
        deadline = time.monotonic() + 60
        while True:  # answering again after SIGCONT
            try:
                if httpx.get(self.url + self.ready_path, timeout=10).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"{self.kind} server not answering {self.ready_path} after SIGCONT:\n{self.tail()}")
            time.sleep(0.5)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, then SIGKILL of the process group after `timeout`; then whatever of the group is left
        (engine core, workers, resource tracker) gets a few seconds to follow and is killed. The exit code."""
        proc = self.proc
        if proc is None:
            return self.returncode
        try:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                self.paused = False
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    print(f"{self.kind} server: no exit {timeout:.0f} s after SIGTERM, SIGKILL", file=sys.stderr)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 15
        while True:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            if time.monotonic() > deadline:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            time.sleep(0.2)
        self.returncode = proc.poll()
        self.proc = None
        self.log.close()
        return self.returncode


def lmc_server(artifact: Path, root: Path, name: str) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "lmc", "runtime", "serve", str(artifact), "--host", "127.0.0.1", "--port", str(port),
            "--request-timeout", "600"]
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_TARGET_DEVICE="cpu")
    return Server("lmc", argv, env, port, "/ping", root / f"lmc-{name}.log")


def vllm_server(flags: list[str], environment: dict[str, str], root: Path, name: str) -> Server:
    port = free_port()
    argv = [sys.executable, str(VLLM_CLI), "serve", *flags, "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", **environment)
    return Server("vllm", argv, env, port, "/health", root / f"vllm-{name}.log")


# ---------------------------------------------------------------- the server's own view

TTFT_SERIES = "vllm:time_to_first_token_seconds_bucket"


def ttft_buckets(metrics_text: str) -> dict[float, float]:
    """vLLM's own TTFT histogram from a /metrics page: cumulative request counts by upper bound (seconds),
    summed over the series' label sets (engines, models). vLLM starts the clock once the API server's
    handler has the request (its prompt rendered), so what the client waits before that (connecting,
    sending, the HTTP server's own queue) is not in it."""
    counts: dict[float, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(TTFT_SERIES + "{"):
            labels, value = line.rsplit(" ", 1)
            bound = re.search(r'le="([^"]+)"', labels)
            if bound:
                le = float(bound.group(1))
                counts[le] = counts.get(le, 0.0) + float(value)
    return counts


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile `q` of the requests counted between two
    scrapes (None: none counted)."""
    delta = {le: count - before.get(le, 0.0) for le, count in after.items()}
    total = delta.get(math.inf, 0.0)
    if total <= 0:
        return None
    return next(le for le in sorted(delta) if delta[le] >= q * total)


def scrape_ttft(server: "Server") -> dict[float, float] | None:
    """The server's TTFT histogram now; None when its /metrics does not answer (the run's figure is then
    left out, the run itself is not lost)."""
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
            return ttft_buckets(response.read().decode())
    except OSError as exc:  # URLError and timeouts included
        print(f"{server.kind}: /metrics did not answer ({exc}); its own TTFT is left out", file=sys.stderr)
        return None


# ---------------------------------------------------------------- the client

def bench_serve(server: Server, model_id: str, artifact: Path, concurrency: int, requests: int, seed: int,
                args, root: Path, tag: str) -> tuple[dict[str, Any], list[str]]:
    """One `vllm bench serve` run against `server`: its JSON result (with per-request detail) and its command."""
    result_name = f"result-{tag}.json"
    argv = [sys.executable, str(VLLM_CLI), "bench", "serve",
            "--backend", "vllm", "--base-url", server.url, "--endpoint", "/v1/completions",
            "--model", model_id, "--tokenizer", str(artifact),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", str(args.temperature),
            "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
            "--num-warmups", str(concurrency if args.warmups is None else args.warmups),
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(root), "--result-filename", result_name,
            "--disable-tqdm"]
    log_path = root / f"client-{tag}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"), start_new_session=True,
                                cwd=str(root))
        try:
            rc = proc.wait(args.run_timeout)
        except BaseException as exc:  # its own session: Ctrl-C does not reach it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise BenchError(f"vllm bench serve ({tag}) ran past {args.run_timeout} s; see {log_path}") from None
            raise
    if rc != 0 or not (root / result_name).exists():
        raise BenchError(f"vllm bench serve ({tag}) exited {rc}:\n{log_path.read_text(errors='replace')[-3000:]}")
    return json.loads((root / result_name).read_text()), argv


# ---------------------------------------------------------------- figures

def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation, as numpy.percentile (what vllm bench serve uses)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's figures over its runs at one model and concurrency: throughput = all output tokens /
    all durations; TTFT and TPOT percentiles over every successful request of every run (TPOT as vLLM
    computes it: (latency - TTFT) / (output tokens - 1))."""
    results = [run["result"] for run in runs if run.get("result")]
    if not results:
        return {}
    ttfts, tpots = [], []
    for res in results:
        for ttft, latency, out, err in zip(res["ttfts"], res["latencies"], res["output_lens"], res["errors"]):
            if err or not ttft:
                continue
            ttfts.append(ttft * 1000)
            if out and out > 1:
                tpots.append((latency - ttft) / (out - 1) * 1000)
    per_run = [res["output_throughput"] for res in results]
    errors = sorted({err.strip().splitlines()[-1][:120] for res in results for err in res["errors"] if err})
    loads = [run[key][0] for run in runs if run.get("result") for key in ("load_before", "load_after")]
    return {
        "runs": len(results),
        "output_throughput": sum(res["total_output_tokens"] for res in results) / sum(res["duration"] for res in results),
        "output_throughput_runs": per_run,
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "tpot_p50_ms": percentile(tpots, 50), "tpot_p99_ms": percentile(tpots, 99),
        "completed": sum(res["completed"] for res in results), "failed": sum(res["failed"] for res in results),
        "errors": errors, "load_1m_min": min(loads), "load_1m_max": max(loads),
        "server_ttft_p99_le_ms_runs": [_ms(run.get("server_ttft_p99_le_s")) for run in runs if run.get("result")],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _f(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(summary: list[dict[str, Any]]) -> str:
    header = (f"{'model':<6} {'conc':>4} {'server':<8} {'runs':>4} {'out tok/s':>9} {'(runs min-max)':>16} "
              f"{'TTFT p50':>9} {'p99 ms':>8} {'TPOT p50':>9} {'p99 ms':>7} {'failed':>9} {'load 1m':>10}")
    lines = [header, "-" * len(header)]
    verdicts = []
    for row in summary:
        for server in SERVERS:
            fig = row[server]
            if not fig:
                lines.append(f"{row['model']:<6} {row['concurrency']:>4} {server:<8} (no result)")
                continue
            runs = fig["output_throughput_runs"]
            spread = f"{min(runs):.0f}-{max(runs):.0f}"
            failed = f"{fig['failed']}/{fig['failed'] + fig['completed']}"
            load = f"{fig['load_1m_min']:.1f}-{fig['load_1m_max']:.1f}"
            lines.append(f"{row['model']:<6} {row['concurrency']:>4} {server:<8} {fig['runs']:>4} "
                         f"{fig['output_throughput']:>9.1f} {spread:>16} {_f(fig['ttft_p50_ms']):>9} "
                         f"{_f(fig['ttft_p99_ms']):>8} {_f(fig['tpot_p50_ms'], '{:.2f}'):>9} "
                         f"{_f(fig['tpot_p99_ms'], '{:.2f}'):>7} {failed:>9} {load:>10}")
        ratios = row.get("ratios")
        if ratios:
            def verdict(met):
                return "n/a, failed requests" if met is None else "met" if met else "MISSED"

            checks = [f"throughput {_f(ratios['throughput'], '{:.2f}')}x "
                      f"({verdict(ratios['throughput_met'])}: >= {TARGET_THROUGHPUT}x)",
                      f"TTFT p99 {_f(ratios['ttft_p99'], '{:.2f}')}x "
                      f"({verdict(ratios['ttft_p99_met'])}: <= {TARGET_TTFT_P99}x)",
                      f"TPOT p50 {_f(ratios['tpot_p50'], '{:.2f}')}x"]
            if ratios.get("no_failures_met") is not None:
                checks.append(f"lmc failed {row['lmc']['failed']} "
                              f"({'met' if ratios['no_failures_met'] else 'MISSED'}: none at {NO_FAILURES_AT})")
            lines.append(f"{row['model']:<6} {row['concurrency']:>4} {'lmc/vllm':<8} " + "; ".join(checks))
        own = [f"{server} " + ", ".join(_f(bound, "{:.0f}") for bound in (row[server] or {}).get(
            "server_ttft_p99_le_ms_runs", [])) for server in SERVERS]
        lines.append(f"{'':<6} {'':>4} {'':<8} vLLM's own TTFT p99 per run, at most (ms, its histogram's bucket): "
                     + "; ".join(own))
        lines.append("")
        for server in SERVERS:
            for err in (row[server] or {}).get("errors", [])[:3]:
                verdicts.append(f"  {row['model']} c={row['concurrency']} {server} failed requests: {err}")
    if verdicts:
        lines += ["errors of failed requests (first 3 distinct per server):", *verdicts]
    return "\n".join(lines).rstrip()


def ratios_of(lmc: dict[str, Any], vllm: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    if not lmc or not vllm:
        return None

    def ratio(key):
        a, b = lmc.get(key), vllm.get(key)
        return a / b if a is not None and b and b > 1e-3 else None  # a TPOT of ~0: the stream came in one burst

    out = {"throughput": ratio("output_throughput"), "ttft_p99": ratio("ttft_p99_ms"), "tpot_p50": ratio("tpot_p50_ms")}
    # failed requests make the figures incomparable: a refused request costs nothing and counts no TTFT
    out["comparable"] = lmc["failed"] == 0 and vllm["failed"] == 0
    out["throughput_met"] = (out["throughput"] is not None and out["throughput"] >= TARGET_THROUGHPUT
                             if out["comparable"] else None)
    out["ttft_p99_met"] = (out["ttft_p99"] is not None and out["ttft_p99"] <= TARGET_TTFT_P99
                           if out["comparable"] else None)
    out["no_failures_met"] = lmc["failed"] == 0 if concurrency == NO_FAILURES_AT else None
    return out


def missed(summary: list[dict]) -> list[str]:
    """The targets a run missed, one label each (a target that could not be judged counts as missed)."""
    out = []
    for row in summary:
        ratios = row.get("ratios")
        if not ratios:
            continue
        # None for a ratio: failed requests left it unjudged (missed); for no_failures_met: not this concurrency
        checks = [("throughput", ratios["throughput_met"]), ("TTFT p99", ratios["ttft_p99_met"])]
        if ratios["no_failures_met"] is not None:
            checks.append(("no failed request", ratios["no_failures_met"]))
        out += [f"{row['model']} c={row['concurrency']} {label}" for label, met in checks if met is not True]
    return out


# ---------------------------------------------------------------- main

def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,512", help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--concurrency", type=_ints, default=[16, 128], help="comma-separated (default 16,128)")
    parser.add_argument("--runs", type=int, default=2,
                        help="runs per server and concurrency, in pairs: lmc, vllm then vllm, lmc (A B B A)")
    parser.add_argument("--requests-16", type=int, default=320, help="requests per run at concurrency 16")
    parser.add_argument("--requests-128", type=int, default=400, help="requests per run at concurrency 128")
    parser.add_argument("--requests", default="", metavar="C:N,...",
                        help="requests per run at other concurrencies (default 6 x C)")
    parser.add_argument("--input-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="sent with every request (0: greedy)")
    parser.add_argument("--warmups", type=int, default=None, help="warm-up requests per run (default: C)")
    parser.add_argument("--seed", type=int, default=0, help="prompts: seed + 1000 x concurrency index + run")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--run-timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, default=None, help="write every figure and raw result here")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work in this directory (artifacts, logs, raw results) and keep it")
    args = parser.parse_args(argv)
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in args.models if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; expected {', '.join(MODELS)}")
    requests = {16: args.requests_16, 128: args.requests_128}
    for item in filter(None, (part.strip() for part in args.requests.split(","))):
        conc, _, count = item.partition(":")
        requests[int(conc)] = int(count)
    args.requests_for = {c: requests.get(c, 6 * c) for c in args.concurrency}
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vllm_server_parity: vLLM is not installed", file=sys.stderr)
        return 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    previous_term = signal.signal(signal.SIGTERM, on_sigterm)
    root = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="lmc-vllm-parity-"))
    root.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    report: dict[str, Any] = {
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()}, "models": {}, "runs": [],
        "targets": {"throughput_ratio_min": TARGET_THROUGHPUT, "ttft_p99_ratio_max": TARGET_TTFT_P99,
                    "no_failed_requests_at_concurrency": NO_FAILURES_AT}}
    broken: list[str] = []
    interrupted = False
    try:
        from lmc.runtime.vllm_backend import engine_environment, serve_arguments

        print(f"work dir {root}; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}", flush=True)
        for name in args.models:
            print(f"[{name}] building", flush=True)
            artifact = build(root, name)
            plan = json.loads((artifact / "lmc.json").read_text())["plan"]
            flags = serve_arguments(plan, artifact)
            environment = engine_environment(plan)
            model_id = plan["model"]["id"]
            info = report["models"][name] = {
                "config": MODELS[name], "plan_vllm": plan.get("vllm"), "plan_kv_cache": plan.get("kv_cache"),
                "engine_environment": environment, "vllm_serve_argv": flags}
            print(f"[{name}] vllm serve {' '.join(flags)}; environment {environment}", flush=True)
            pair = {"lmc": lmc_server(artifact, root, name), "vllm": vllm_server(flags, environment, root, name)}
            try:
                for kind in SERVERS:
                    servers.append(pair[kind])
                    pair[kind].start(args.start_timeout)
                    pair[kind].pause()
                    print(f"[{name}] {kind} ready in {pair[kind].ready_s:.1f} s (port {pair[kind].port})", flush=True)
                info["ready_s"] = {kind: pair[kind].ready_s for kind in SERVERS}
                info["vllm_serve_command"] = pair["vllm"].argv[1:]
                logged = {kind: engine_config(pair[kind].log_path) for kind in SERVERS}
                info["engine_config_logged"] = logged
                info["engine_config_differences"] = differences = config_differences(logged["lmc"], logged["vllm"])
                if differences:
                    print(f"[{name}] the engine configurations differ:\n  " + "\n  ".join(differences), flush=True)
                else:
                    print(f"[{name}] the engine configurations vLLM logged are the same ({len(logged['lmc']['config']['items'])} "
                          f"items; {logged['lmc']['kv_cache']})", flush=True)
                for ci, concurrency in enumerate(args.concurrency):
                    requests = args.requests_for[concurrency]
                    for run in range(args.runs):
                        seed = args.seed + 1000 * ci + run
                        for position, kind in enumerate(pair_order(run)):
                            server = pair[kind]
                            record = {"model": name, "concurrency": concurrency, "requests": requests, "run": run,
                                      "server": kind, "position": position, "seed": seed}
                            report["runs"].append(record)
                            try:
                                server.resume()
                                time.sleep(1.0)
                                record["load_before"] = os.getloadavg()
                                before = scrape_ttft(server)
                                started = time.monotonic()
                                record["result"], record["client_argv"] = bench_serve(
                                    server, model_id, artifact, concurrency, requests, seed, args, root,
                                    f"{name}-c{concurrency}-r{run}-{kind}")
                                record["wall_s"] = time.monotonic() - started
                                # vLLM's own TTFT p99 over the run (its warm-ups included), by histogram bucket
                                after = scrape_ttft(server)
                                record["server_ttft_p99_le_s"] = (None if before is None or after is None
                                                                  else bucket_quantile(before, after, 0.99))
                                record["load_after"] = os.getloadavg()
                            except BenchError as exc:
                                record["error"] = str(exc)
                                record.setdefault("load_after", os.getloadavg())
                                record.setdefault("load_before", record["load_after"])
                                broken.append(f"{name} c={concurrency} run {run} {kind}: {str(exc).splitlines()[0]}")
                                print(f"[{name}] c={concurrency} run {run} {kind}: ERROR {exc}", file=sys.stderr, flush=True)
                                continue
                            finally:
                                server.pause()
                            res = record["result"]
                            print(f"[{name}] c={concurrency} run {run} {kind:<4} ({'first' if position == 0 else 'second'}): "
                                  f"{res['output_throughput']:.1f} tok/s, "
                                  f"TTFT p50 {res.get('p50_ttft_ms', 0):.1f} p99 {res.get('p99_ttft_ms', 0):.1f} ms "
                                  f"(vLLM's own p99 <= {_f(_ms(record['server_ttft_p99_le_s']), '{:.0f}')} ms), "
                                  f"TPOT p50 {res.get('p50_tpot_ms', 0):.2f} ms, {res['completed']} ok "
                                  f"{res['failed']} failed in {res['duration']:.1f} s; load "
                                  f"{record['load_before'][0]:.2f} -> {record['load_after'][0]:.2f}", flush=True)
            finally:
                info["exit_codes"] = {kind: pair[kind].stop() for kind in SERVERS}
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("\ninterrupted: stopping the servers", file=sys.stderr)
        broken.append("interrupted")
        interrupted = True
    except BenchError as exc:
        print(f"vllm_server_parity: {exc}", file=sys.stderr)
        broken.append(str(exc).splitlines()[0])
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for server in servers:
            server.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous_term)

    summary = []
    for name in args.models:
        for concurrency in args.concurrency:
            runs = {kind: [r for r in report["runs"] if r["model"] == name and r["concurrency"] == concurrency
                           and r["server"] == kind] for kind in SERVERS}
            if not any(runs.values()):
                continue
            row = {"model": name, "concurrency": concurrency, **{kind: pooled(runs[kind]) for kind in SERVERS}}
            row["ratios"] = ratios_of(row["lmc"], row["vllm"], concurrency)
            summary.append(row)
    report["summary"] = summary
    report["broken"] = broken
    report["machine"]["load_at_end"] = os.getloadavg()
    if summary:
        print(f"\nlmc runtime vs vllm serve, vllm bench serve: random {args.input_len} tokens in, {args.output_len} out "
              f"(ignore_eos, temperature {args.temperature}), {os.cpu_count()} CPUs; figures pooled over the runs; "
              f"load = 1-minute load average before/after the runs")
        print(table(summary))
    for name, info in report["models"].items():
        if "engine_config_differences" not in info:
            continue
        differences = info["engine_config_differences"]
        print(f"{name}: engine configuration logged by vLLM: " + (
            "DIFFERENT: " + "; ".join(differences) if differences else
            f"the same for both ({len(info['engine_config_logged']['lmc']['config']['items'])} items)") +
            f"; ready in lmc {info['ready_s']['lmc']:.0f} s, vllm {info['ready_s']['vllm']:.0f} s"
            + (f"; exit codes {info['exit_codes']}" if info.get("exit_codes") else ""))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"raw results: {args.json}")
    if args.keep:
        print(f"artifacts, logs and results kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    if broken:
        print("errors: " + "; ".join(broken), file=sys.stderr)
        return 130 if interrupted else 1
    if missed(summary):
        print("targets missed: " + "; ".join(missed(summary)), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
