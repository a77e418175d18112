"""vLLM bench: `lmc runtime` serving the same model with the vllm engine (continuous batching) and with the
hf engine (dynamic batching), same machine, same run, same load.

Builds a random-weight Llama of about 89 M parameters in bf16 (768 wide, 14 layers, 12 heads of 64, 4 KV
heads), then `lmc build`s it twice from specs that differ only in `[pin] engine` (vllm / hf; both plan
batch 16 for a concurrency of 16), and serves each artifact with `lmc runtime` in its own process. The
load, from this process: --requests (32) streamed /v1/completions at --concurrency (16), greedy, output
lengths drawn once (seeded) from 8..128 tokens and sent with ignore_eos so every answer has its length,
prompts of 10-22 words (24-64 tokens of this tokenizer). Output throughput = generated tokens / wall time of the load; TTFT = request sent
-> first streamed text, p50 and p99 over the requests. A warm-up round precedes each measurement.

Target: vLLM >= 2x the hf engine's throughput and a lower TTFT p99; exit 1 when missed. The host is
shared: `uptime`'s load is printed before and after each engine's run; rerun when it is high.

Usage: python bench/vllm_bench.py [--requests 32] [--concurrency 16] [--runs 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TARGET_THROUGHPUT_RATIO = 2.0
MODEL = dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
             num_hidden_layers=14)

SPEC = """\
[model]
id = "bench/llama-89m"
path = "{path}"

[target]
instance = "local"

[budget]
memory_per_device = "4GiB"  # a small KV pool: the host is shared

[workload]
max_input_tokens = 64
max_output_tokens = 128
concurrency = 16

[pin]
engine = "{engine}"
dtype = "bf16"
tensor_parallel_degree = 1
replicas = 1
"""

WORDS = ("the quick brown fox jumps over the lazy dog a large language model reads a prompt and writes the next "
         "word serving such a model well is a matter of memory and time").split()


def build(root: Path, engine: str, checkpoint: Path) -> Path:
    from lmc.cli.main import main

    spec = root / f"{engine}.toml"
    spec.write_text(SPEC.format(path=checkpoint.as_posix(), engine=engine))
    out = root / f"artifact-{engine}"
    if main(["build", str(spec), "--format", "dir", "-o", str(out)]) != 0:
        raise SystemExit(f"lmc build failed for {engine}")
    return out


def workload(requests: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 22))), rng.randint(8, 128))
            for _ in range(requests)]


class Runtime:
    """`lmc runtime` serving `artifact` in a child process (its log in `log_path`)."""

    def __init__(self, artifact: Path, port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "lmc", "runtime", "serve", str(artifact), "--port", str(port),
                                      "--request-timeout", "600"], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)

    def __enter__(self):
        import httpx

        started = time.monotonic()
        while time.monotonic() - started < 600:
            if self.proc.poll() is not None:
                raise SystemExit(f"lmc runtime exited {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/ping", timeout=5).status_code == 200:
                    self.ready_s = time.monotonic() - started
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"lmc runtime not ready after 600 s; see {self.log.name}")

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


async def stream_completion(client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float | None, float | None, int]:
    """One streamed greedy completion of exactly `max_tokens` (ignore_eos): the monotonic times of its first and
    last text chunks and its completion tokens (the usage vLLM streams last). A non-200 or an error event raises."""
    first = last = None
    count = 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:300]}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                last = time.monotonic()
                first = first or last
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
    return first, last, count


async def load(url: str, items: list[tuple[str, int]], concurrency: int) -> dict:
    """Stream every item's completion, `concurrency` at a time; tokens, wall time and TTFTs."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    # the served model's name: vLLM's server answers 404 to any other
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    ttfts: list[float] = []
    tokens = 0

    async def one(client, prompt: str, length: int) -> None:
        nonlocal tokens
        async with gate:
            sent = time.monotonic()
            first, _, count = await stream_completion(client, url, model, prompt, length)
            tokens += count
            ttfts.append((first or time.monotonic()) - sent)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        started = time.monotonic()
        await asyncio.gather(*(one(client, prompt, length) for prompt, length in items))
        wall = time.monotonic() - started
    return {"tokens": tokens, "seconds": wall, "ttfts": ttfts}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]  # nearest rank: p99 of 32 is the largest


def uptime() -> str:
    with open("/proc/loadavg") as handle:
        return "load " + " ".join(handle.read().split()[:3])


def measure(engine: str, artifact: Path, items: list[tuple[str, int]], args, root: Path) -> dict:
    from lmc.runtime.workers import free_port

    before = uptime()
    with Runtime(artifact, free_port(), root / f"runtime-{engine}.log") as served:
        asyncio.run(load(served.url, [(prompt, 8) for prompt, _ in items[:args.concurrency]], args.concurrency))  # warm-up
        runs = [asyncio.run(load(served.url, items, args.concurrency)) for _ in range(args.runs)]
    best = max(runs, key=lambda run: run["tokens"] / run["seconds"])
    result = {"engine": engine, "ready_s": round(served.ready_s, 1), "tokens": best["tokens"],
              "seconds": round(best["seconds"], 2), "tokens_per_s": round(best["tokens"] / best["seconds"], 1),
              "ttft_p50_ms": round(1000 * statistics.median(best["ttfts"]), 1),
              "ttft_p99_ms": round(1000 * percentile(best["ttfts"], 99), 1), "uptime_before": before,
              "uptime_after": uptime()}
    print(f"{engine:>4}: {result['tokens']} tokens in {result['seconds']} s = {result['tokens_per_s']} tokens/s; "
          f"TTFT p50 {result['ttft_p50_ms']} ms, p99 {result['ttft_p99_ms']} ms (ready in {result['ready_s']} s; "
          f"{before} -> {result['uptime_after']})", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--runs", type=int, default=1, help="measured runs per engine (the best is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from lmc.testing.checkpoints import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="lmc-vllm-bench-") as tmp:
        root = Path(tmp)
        checkpoint = make_checkpoint("llama", root / "ckpt", dtype="bfloat16", **MODEL)
        artifacts = {engine: build(root, engine, checkpoint) for engine in ("vllm", "hf")}
        items = workload(args.requests, args.seed)
        print(f"model: random Llama, {MODEL}, bf16; {args.requests} requests at concurrency {args.concurrency}, "
              f"output lengths {min(n for _, n in items)}-{max(n for _, n in items)} "
              f"(total {sum(n for _, n in items)} tokens); {os.cpu_count()} cores", flush=True)
        results = {engine: measure(engine, artifact, items, args, root) for engine, artifact in artifacts.items()}
    vllm, hf = results["vllm"], results["hf"]
    ratio = vllm["tokens_per_s"] / hf["tokens_per_s"]
    met = ratio >= TARGET_THROUGHPUT_RATIO and vllm["ttft_p99_ms"] < hf["ttft_p99_ms"]
    summary = {"vllm": vllm, "hf": hf, "throughput_ratio": round(ratio, 2),
               "ttft_p99_ratio": round(vllm["ttft_p99_ms"] / hf["ttft_p99_ms"], 2),
               "target": f"throughput >= {TARGET_THROUGHPUT_RATIO}x and a lower TTFT p99",
               "verdict": "ok" if met else "MISSED"}
    print(json.dumps({key: summary[key] for key in ("throughput_ratio", "ttft_p99_ratio", "target", "verdict")}))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
