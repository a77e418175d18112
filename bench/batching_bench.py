"""Batching bench: throughput of `lmc runtime` with batch_size 1 vs dynamic batching, same model, same run.

Builds a small random Llama with `lmc build` (hf engine, fp32, TP=1, on this CPU), then serves it
twice with the runtime -- once with batch_size 1, once with --batch (default 16) -- and drives each
with --clients concurrent clients (default 32), every client sending --requests greedy
/v1/completions requests of --max-new-tokens tokens. Tokens/s is the sum of usage.completion_tokens
over the wall time of the load. Target: dynamic / batch-1 >= 3.

Exit status 1 when the target is missed, and when the real build fails (one line, no figures: a
stand-in engine whose step costs the same at any batch would meet the target by construction).
Usage: python bench/batching_bench.py [--clients 32] [--batch 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TARGET_RATIO = 3.0

SPEC = """\
[model]
id = "bench/tiny-llama"
path = "{path}"

[target]
instance = "local"

[workload]
max_input_tokens = 64
max_output_tokens = 64
concurrency = 32

[pin]
engine = "hf"
dtype = "fp32"
tensor_parallel_degree = 1
replicas = 1
"""


def build_real(root: Path, spec_text: str = SPEC, **checkpoint_overrides) -> Path:
    from lmc.cli.main import main
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", root / "ckpt", **checkpoint_overrides)
    spec = root / "spec.toml"
    spec.write_text(spec_text.format(path=checkpoint.as_posix()))
    out = root / "artifact"
    code = main(["build", str(spec), "--format", "dir", "-o", str(out)])
    if code != 0:
        raise RuntimeError(f"lmc build exited with {code} (its error is above)")
    return out


def _serve(model_dir: str, plan: dict, port: int) -> None:
    """The runtime's HTTP front end (and its workers) in a process of its own, as `lmc runtime` runs."""
    from lmc.runtime.server import Runtime, make_server

    make_server(Runtime(Path(model_dir), plan, request_timeout_s=600), "127.0.0.1", port).run()


class Served:
    """`plan` served from `model_dir` on a free port until the block ends: in a thread of this process, or
    with `own_process` in a spawned child, so that a load generator here shares no interpreter with it."""

    def __init__(self, model_dir: Path, plan: dict, own_process: bool = False):
        from lmc.runtime.workers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        if own_process:
            import multiprocessing

            self.runner = multiprocessing.get_context("spawn").Process(target=_serve,
                                                                       args=(str(model_dir), plan, self.port))
        else:
            from lmc.runtime.server import Runtime, make_server

            self.server = make_server(Runtime(model_dir, plan, request_timeout_s=600), "127.0.0.1", self.port)
            self.runner = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        import httpx

        self.runner.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.runner.is_alive():
            try:
                if httpx.get(self.url + "/ping").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("the runtime did not become ready")

    def __exit__(self, *exc):
        if self.server is not None:
            self.server.should_exit = True
            self.runner.join(60)
            return
        self.runner.terminate()  # SIGTERM: the runtime drains and stops its workers
        self.runner.join(60)
        if self.runner.is_alive():
            self.runner.kill()
            self.runner.join()


async def load(url: str, clients: int, requests: int, max_new_tokens: int) -> tuple[int, float]:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def one_client(c: int) -> int:
            tokens = 0
            for r in range(requests):
                reply = await client.post(url + "/v1/completions", json={
                    "prompt": f"client {c} request {r}: the quick brown fox", "max_tokens": max_new_tokens,
                    "temperature": 0})
                reply.raise_for_status()
                tokens += reply.json()["usage"]["completion_tokens"]
            return tokens

        start = time.monotonic()
        counts = await asyncio.gather(*(one_client(c) for c in range(clients)))
        return sum(counts), time.monotonic() - start


def measure(model_dir: Path, base_plan: dict, batch: int, args) -> float:
    plan = dict(base_plan, batch_size=batch, max_batch_delay_ms=args.delay_ms, replicas=1,
                job_queue_size=max(base_plan["job_queue_size"], 4 * args.clients))
    with Served(model_dir, plan) as served:
        asyncio.run(load(served.url, min(4, args.clients), 1, 4))  # warm-up
        tokens, seconds = asyncio.run(load(served.url, args.clients, args.requests, args.max_new_tokens))
    rate = tokens / seconds
    print(f"batch_size {batch:>3}: {tokens} tokens in {seconds:.2f} s = {rate:.1f} tokens/s")
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8, help="requests per client")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--delay-ms", type=int, default=20, help="max_batch_delay_ms for the dynamic run")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from lmc.manifest import read_manifest

    with tempfile.TemporaryDirectory(prefix="lmc-batching-bench-") as tmp:
        root = Path(tmp)
        label = "hf engine, tiny random Llama (fp32, TP=1, CPU)"
        try:
            model_dir = build_real(root)
        except Exception as exc:  # no figures without the real engine: the bench failed
            print(f"batching bench FAILED: the build failed ({type(exc).__name__}: {exc}); nothing was measured",
                  file=sys.stderr)
            return 1
        plan = read_manifest(model_dir)["plan"]
        print(f"model: {label}; {args.clients} clients x {args.requests} requests x {args.max_new_tokens} new tokens")
        single = measure(model_dir, plan, 1, args)
        batched = measure(model_dir, plan, args.batch, args)
    ratio = batched / single
    verdict = "ok" if ratio >= TARGET_RATIO else "MISSED"
    print(json.dumps({"engine": label, "tokens_per_s_batch1": round(single, 1),
                      f"tokens_per_s_batch{args.batch}": round(batched, 1), "ratio": round(ratio, 2),
                      "target": TARGET_RATIO, "verdict": verdict}))
    return 0 if ratio >= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
