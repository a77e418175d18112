"""Continuous against dynamic batching in `lmc runtime`, same model, same run.

Builds the tiny random Llama with `lmc build` (hf engine, fp32, TP=1, this CPU), serves it (the runtime's
front end and one worker, in a process of their own, apart from this load generator) once with
dynamic batching (batch_size 16, max_batch_delay 20 ms) and once with continuous batching (16
sequences), and runs two workloads against each (greedy, ignore_eos so every answer has its length):

  (a) one request of 256 new tokens, then 100 ms later 8 requests of 8 tokens: the short requests'
      completion time p50. Target: continuous <= 0.3 x dynamic. Also printed: the long one's own time
      (under dynamic batching the shorts wait for what is left of it after 0.1 s).
  (b) 32 requests at concurrency 16 (closed loop: each client sends its next request when its last one
      is answered), new tokens drawn uniformly from 8..128 (a fixed draw): output tokens/s (target:
      continuous >= 1.5 x dynamic) and TTFT p99 (target: lower). Streamed, so TTFT is the first
      line's arrival. Also printed, without a target, as "bimodal_*": the same with half the requests
      8 tokens and half 128, in a fixed shuffled order. "step_bound" is the ratio (b) could reach at
      best if a step cost the same whatever its rows (see step_bound): the target is above it.
  Open loop (no target), as "open_*": 64 requests of lengths drawn like (b)'s, arriving as a Poisson
      process (BENCH_OPEN_RATE, 60 per second: about half of what the server can generate here), each
      sent at its time whatever the server does, as users arrive: TTFT p50 and p99, completion p50. In
      (b)'s closed loop at concurrency = batch size every dynamic batch starts full; here requests
      arrive while a batch runs.
  Engine level (no target): the decode loop alone on (b)'s lengths, all waiting from the start: lmc's
      dynamic batches, the same batches keeping finished rows (HF generate's way), continuous batching.

BENCH_HIDDEN=512 runs a wider model (512 wide, 4 layers) instead of the tiny one.
Both servers run side by side and take turns, each workload 5 times (BENCH_REPEATS); figures are medians.
Prints `uptime` (the machine is shared: rerun when the load is high) and exits 1 when a target is missed.
Usage: python bench/continuous_bench.py
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from batching_bench import SPEC as BATCHING_SPEC, Served, build_real  # noqa: E402

# batching_bench's tiny Llama spec, with room for 256 new tokens and 16 concurrent requests.
SPEC = BATCHING_SPEC.replace("max_output_tokens = 64", "max_output_tokens = 256").replace("concurrency = 32",
                                                                                            "concurrency = 16")


# uvicorn closes a connection idle for 5 s (the runtime's timeout_keep_alive): one idle longer is not reused.
KEEP_ALIVE_S = 4.0


class Connections:
    """The load generator's keep-alive HTTP/1.1 connections to one server (h11, the protocol library under
    httpx and uvicorn, over asyncio streams), opened once and reused, as a client's pool does. Not httpx:
    this host has 2 cores, one decoding and the other shared by the server's front end and this client,
    and httpx's per-request and per-line work (51 ms of CPU per repeat of (a), measured with psutil) held
    up the front end: the short requests of (a) took 20 ms under continuous batching with httpx, 14.5 ms
    with this client, the server unchanged."""

    def __init__(self, url: str):
        from urllib.parse import urlsplit

        where = urlsplit(url)
        self.host, self.port = where.hostname, where.port
        self.idle: list[tuple] = []

    async def close(self) -> None:
        for (_, writer, _), _ in self.idle:
            writer.close()
        self.idle.clear()

    async def request(self, prompt: str, tokens: int) -> tuple[float, float, int]:
        """Stream one LMI request: (seconds to the first streamed line, seconds to the end, tokens generated)."""
        import h11

        conn = None
        while self.idle and conn is None:
            conn, used = self.idle.pop()
            if time.monotonic() - used > KEEP_ALIVE_S or conn[0].at_eof():  # the server may have closed it
                conn[1].close()
                conn = None
        if conn is None:
            conn = (*await asyncio.open_connection(self.host, self.port), h11.Connection(h11.CLIENT))
        reader, writer, http = conn
        body = json.dumps({"inputs": prompt, "stream": True, "parameters": {
            "max_new_tokens": tokens, "ignore_eos_token": True, "do_sample": False, "details": True}}).encode()
        start = time.monotonic()
        writer.write(http.send(h11.Request(method="POST", target="/invocations", headers=[
            ("Host", self.host), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]))
                     + http.send(h11.Data(data=body)) + http.send(h11.EndOfMessage()))
        await writer.drain()
        first, pending, last = None, b"", b""
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response) and event.status_code != 200:
                raise RuntimeError(f"HTTP {event.status_code}")
            elif isinstance(event, h11.Data):
                *lines, pending = (pending + event.data).split(b"\n")
                lines = [line for line in lines if line.strip()]
                if lines:
                    first = first if first is not None else time.monotonic() - start
                    last = lines[-1]
            elif isinstance(event, h11.EndOfMessage):
                break
        end = time.monotonic() - start
        http.start_next_cycle()
        self.idle.append((conn, time.monotonic()))
        answer = json.loads(last or pending)
        if "generated_text" not in answer:
            raise RuntimeError(f"stream ended without an answer: {answer}")
        if answer["details"]["generated_tokens"] != tokens:
            raise RuntimeError(f"asked for {tokens} tokens, got {answer['details']['generated_tokens']}")
        return first, end, tokens


async def short_after_long(client: Connections) -> tuple[float, float]:
    """(a): p50 completion time of the 8 short requests, and the long one's (when it ends before the short
    ones arrive, at 0.1 s, there is nothing to overtake)."""
    long = asyncio.create_task(client.request("a long answer: the quick brown fox", 256))
    await asyncio.sleep(0.1)
    shorts = await asyncio.gather(*(client.request(f"short {i}: hello there", 8) for i in range(8)))
    _, long_s, _ = await long
    return statistics.median(end for _, end, _ in shorts), long_s


async def mixed(client: Connections, lengths: list[int], concurrency: int) -> tuple[float, float]:
    """(b): (output tokens/s, TTFT p99) for `lengths` at `concurrency`."""
    queue = list(enumerate(lengths))
    results = []

    async def worker() -> None:
        while queue:
            index, tokens = queue.pop(0)
            results.append(await client.request(f"request {index}: the quick brown fox", tokens))

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.monotonic() - start
    ttfts = sorted(first for first, _, _ in results)
    if os.environ.get("BENCH_VERBOSE"):
        print("  TTFTs:", [round(t, 3) for t in ttfts], "wall", round(wall, 3))
    return sum(tokens for _, _, tokens in results) / wall, _p99(ttfts)


async def open_loop(client: Connections, lengths: list[int], gaps: list[float]) -> tuple[float, float, float]:
    """Requests sent at fixed times whatever the server does (request i after the sum of gaps[:i+1]), as users
    arrive: (TTFT p50, TTFT p99, completion p50) in seconds."""
    async def send(index: int, at: float, tokens: int) -> tuple[float, float, int]:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
        return await client.request(f"request {index}: the quick brown fox", tokens)

    start, at, sends = time.monotonic(), 0.0, []
    for index, (tokens, gap) in enumerate(zip(lengths, gaps)):
        at += gap
        sends.append(send(index, at, tokens))
    results = await asyncio.gather(*sends)
    ttfts, ends = sorted(first for first, _, _ in results), sorted(end for _, end, _ in results)
    return statistics.median(ttfts), _p99(ttfts), statistics.median(ends)


def _p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile of `values` (of 32 requests the largest, of 64 the second largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def step_bound(lengths: list[int], slots: int = 16) -> float:
    """The most continuous batching can gain over lmc's dynamic batching on `lengths` if a decode step cost
    the same whatever its rows: the steps dynamic batching takes (batches of `slots` in arrival order,
    each as long as its longest request) over those continuous batching takes (a slot taken again at the
    next step), with every request waiting from the start. lmc's dynamic batches already drop a row as
    it finishes, so both compute the same row-steps: where a step costs a + b x rows, the ratio of their
    times lies between 1 (a = 0) and this (b = 0)."""
    dynamic = sum(max(lengths[i:i + slots]) for i in range(0, len(lengths), slots))
    waiting, running, steps = list(lengths), [], 0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append(waiting.pop(0))
        running = [left - 1 for left in running if left > 1]
        steps += 1
    return dynamic / steps


def run(model_dir: Path, plans: dict[str, dict], lengths: list[int], bimodal: list[int], arrivals: tuple[list, list],
        repeats: int) -> dict:
    """Both servers up at once, each workload run on one then the other, `repeats` times: a burst of load
    from elsewhere on the machine hits both alike. Each figure is the median of its repeats."""
    from contextlib import ExitStack

    samples: dict[str, dict[str, list[float]]] = {name: {} for name in plans}

    async def workloads(urls: dict[str, str]) -> None:
        clients = {name: Connections(url) for name, url in urls.items()}
        for client in clients.values():
            await mixed(client, [4] * 64, 64)  # warm-up, and the connections the workloads need opened
        for _ in range(repeats):
            for name, client in clients.items():
                add = lambda key, value: samples[name].setdefault(key, []).append(value)  # noqa: E731
                short, long = await short_after_long(client)
                add("short_p50_s", short), add("long_s", long)
                rate, ttft = await mixed(client, lengths, 16)
                add("tokens_per_s", rate), add("ttft_p99_s", ttft)
                rate, ttft = await mixed(client, bimodal, 16)
                add("bimodal_tokens_per_s", rate), add("bimodal_ttft_p99_s", ttft)
                ttft_p50, ttft_p99, end_p50 = await open_loop(client, *arrivals)
                add("open_ttft_p50_s", ttft_p50), add("open_ttft_p99_s", ttft_p99), add("open_end_p50_s", end_p50)
        for client in clients.values():
            await client.close()

    with ExitStack() as stack:
        urls = {name: stack.enter_context(Served(model_dir, plan, own_process=True)).url
                for name, plan in plans.items()}
        asyncio.run(workloads(urls))
    return {name: {key: round(statistics.median(values), 4) for key, values in figures.items()}
            for name, figures in samples.items()}


def engine_level(model_dir: Path, lengths: list[int], slots: int = 16) -> dict[str, float]:
    """Output tokens/s of the decode loop itself (no HTTP, every request waiting from the start) for
    `lengths`: lmc's dynamic batches (16 at a time, each row dropped as it finishes), the same batches
    keeping their finished rows until the longest ends (what HF generate does for a batch, so DJL's
    dynamic batching of a handler built on it: no target, a reference), and continuous batching."""
    import torch

    from lmc.manifest import read_manifest
    from lmc.runtime.engines.base import GenerationParams, GenerationRequest
    from lmc.runtime.engines.hf import HFEngine

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    plan = read_manifest(model_dir)["plan"]
    engine = HFEngine(family="llama", task="text-generation", dtype=plan["dtype"], tensor_parallel_degree=1,
                      max_sequence_length=plan["max_sequence_length"], batch_size=slots, device="cpu")
    engine.load(model_dir, 0, 1)
    loop = engine.loop

    def requests() -> list:
        return [GenerationRequest(id=f"r{i}", prompt=f"request {i}: the quick brown fox",
                                  params=GenerationParams(max_new_tokens=n, ignore_eos=True))
                for i, n in enumerate(lengths)]

    def dynamic(compact: bool) -> float:
        loop.compact = compact
        started = time.perf_counter()
        queue = requests()
        while queue:
            loop.generate(queue[:slots], max_rows=slots)
            del queue[:slots]
        loop.compact = True
        return sum(lengths) / (time.perf_counter() - started)

    def continuous() -> float:
        batch, queue = loop.running_batch(), requests()
        started = time.perf_counter()
        with torch.inference_mode():
            while queue or len(batch):
                free = slots - len(batch)
                if free > 0 and queue:
                    batch.join(queue[:free])
                    del queue[:free]
                batch.step()
        return sum(lengths) / (time.perf_counter() - started)

    runs = {"dynamic": [], "dynamic_keeping_finished_rows": [], "continuous": []}
    dynamic(True), continuous()  # warm-up
    for _ in range(3):
        runs["dynamic"].append(dynamic(True))
        runs["dynamic_keeping_finished_rows"].append(dynamic(False))
        runs["continuous"].append(continuous())
    return {name: round(statistics.median(values), 1) for name, values in runs.items()}


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lmc.manifest import read_manifest

    draw = random.Random(14)
    uniform = [draw.randint(8, 128) for _ in range(32)]
    bimodal = [8, 128] * 16
    draw.shuffle(bimodal)
    # Open loop: 64 requests of (b)'s lengths arriving as a Poisson process at OPEN_RATE per second.
    rate = float(os.environ.get("BENCH_OPEN_RATE", "60"))
    arrivals = ([draw.randint(8, 128) for _ in range(64)], [draw.expovariate(rate) for _ in range(64)])
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory(prefix="lmc-continuous-bench-") as tmp:
        hidden = int(os.environ.get("BENCH_HIDDEN", "0"))  # 0: the tiny model; else a wider one, 4 layers
        wider = dict(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4) if hidden else {}
        model_dir = build_real(Path(tmp), SPEC, **wider)
        plan = read_manifest(model_dir)["plan"]
        common = dict(replicas=1, job_queue_size=max(64, plan["job_queue_size"]))
        dynamic_plan = dict(plan, **common, scheduling="dynamic", batch_size=16, max_batch_delay_ms=20)
        dynamic_plan.pop("kv_cache", None)
        continuous_plan = dict(plan, **common, scheduling="continuous", batch_size=16,
                               kv_cache=plan.get("kv_cache") or {"block_size": 16, "blocks": 16 * 20,
                                                                  "max_concurrent_sequences": 16})
        print(f"plan: scheduling {plan.get('scheduling')}, kv_cache {plan.get('kv_cache')}")
        figures = run(model_dir, {"dynamic": dynamic_plan, "continuous": continuous_plan}, uniform, bimodal, arrivals,
                      int(os.environ.get("BENCH_REPEATS", "5")))
        dynamic, continuous = figures["dynamic"], figures["continuous"]
        print("dynamic:   ", dynamic)
        print("continuous:", continuous)
        engine = engine_level(model_dir, uniform)
        print("engine level, tokens/s (no target):", engine)
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    ratio_a = continuous["short_p50_s"] / dynamic["short_p50_s"]
    ratio_b = continuous["tokens_per_s"] / dynamic["tokens_per_s"]
    checks = {"(a) short p50 ratio <= 0.3": ratio_a <= 0.3, "(b) throughput ratio >= 1.5": ratio_b >= 1.5,
              "(b) TTFT p99 lower": continuous["ttft_p99_s"] < dynamic["ttft_p99_s"]}
    print(json.dumps({"dynamic": dynamic, "continuous": continuous, "short_p50_ratio": round(ratio_a, 3),
                      "throughput_ratio": round(ratio_b, 2), "checks": checks,
                      "open_loop_ratios": {key: round(continuous[f"open_{key}_s"] / dynamic[f"open_{key}_s"], 3)
                                           for key in ("ttft_p50", "ttft_p99", "end_p50")},
                      "step_bound": round(step_bound(uniform), 2),
                      "bimodal_step_bound": round(step_bound(bimodal), 2),
                      "engine_level": engine,
                      "engine_level_ratios": {
                          "continuous/dynamic": round(engine["continuous"] / engine["dynamic"], 2),
                          "continuous/dynamic_keeping_finished_rows":
                              round(engine["continuous"] / engine["dynamic_keeping_finished_rows"], 2)}}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
