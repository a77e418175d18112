"""Speculative decoding bench: `lmc runtime` serving the same model with `[speculative] method = "ngram"` and
without, same machine, same run, on a repetitive workload (where prompt lookup finds the continuation),
measured beside what `lmc plan` predicts for each. The speculating artifact is built with acceptance_rate
0.9, so that its plan keeps speculation on at every level (the planner would turn it off where it predicts
no gain; here it runs so the gain or loss is measured).

Builds bench/vllm_bench.py's random Llama (about 89 M parameters, bf16), then `lmc build`s it twice from specs
that differ only in `[speculative]` (ngram, --tokens proposed a step; and none), and serves each artifact with
`lmc runtime` in its own process. The load, from this process, at each --levels concurrency: --requests
streamed /v1/completions, greedy, --output tokens each (ignore_eos), prompts of one phrase repeated four
times. TPOT = (last token - first token) / (tokens - 1) per request, p50; throughput = generated tokens /
wall time. vLLM's own counters give the measured acceptance (accepted / proposed tokens). Beside each figure:
the plan's prediction at that concurrency, with the planner's default acceptance for ngram and with the
measured one (`acceptance_rate` in the spec), so a miss can be told apart from a wrong acceptance guess.

There is no target: the figures are printed as measured (whether speculation pays on this host or not).

Usage: python bench/speculative_bench.py [--levels 1,8] [--requests 16] [--output 64] [--tokens 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from vllm_bench import MODEL, SPEC, Runtime, stream_completion, uptime  # noqa: E402  (the same model, spec, server harness and client)

PHRASES = ("the quick brown fox jumps over the lazy dog", "a model reads a prompt and writes the next word",
           "serving a model well is a matter of memory and time", "one two three four five six seven eight")


def spec_text(checkpoint: Path, output: int, concurrency: int, tokens: int | None, rate: float | None = None) -> str:
    speculative = ""
    if tokens is not None:
        speculative = f'\n[speculative]\nmethod = "ngram"\nnum_tokens = {tokens}\n'
        if rate is not None:
            speculative += f"acceptance_rate = {rate:.3f}\n"
    text = SPEC.format(path=checkpoint.as_posix(), engine="vllm")  # vllm_bench's: 128 tokens at concurrency 16
    for key, value in (("max_output_tokens", output), ("concurrency", concurrency)):
        line = next(line for line in text.splitlines() if line.startswith(f"{key} = "))
        text = text.replace(line, f"{key} = {value}")
    return text + speculative


def predicted(root: Path, text: str) -> dict:
    """`lmc plan` of `text`: TPOT, throughput, and whether the plan keeps speculation on."""
    from lmc.pipeline import plan_from_spec
    from lmc.schema import load_spec

    path = root / "predict.toml"
    path.write_text(text)
    plan = plan_from_spec(load_spec(path)).plan
    return {"tpot_ms": plan.predicted.tpot_ms, "tokens_per_s": plan.predicted.throughput_tokens_per_s,
            "speculation": plan.speculative.enabled if plan.speculative else None}


def build(root: Path, name: str, text: str) -> Path:
    from lmc.cli.main import main

    spec = root / f"{name}.toml"
    spec.write_text(text)
    out = root / f"artifact-{name}"
    if main(["build", str(spec), "--format", "dir", "-o", str(out)]) != 0:
        raise SystemExit(f"lmc build failed for {name}")
    return out


async def load(url: str, prompts: list[str], output: int, concurrency: int) -> dict:
    """Stream every prompt's completion, `concurrency` at a time: per-request TPOTs, tokens, wall time."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    tpots: list[float] = []
    tokens = 0

    async def one(client, prompt: str) -> None:
        nonlocal tokens
        async with gate:
            first, last, count = await stream_completion(client, url, model, prompt, output)
            tokens += count
            if first is not None and count > 1:
                tpots.append((last - first) / (count - 1))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        started = time.monotonic()
        await asyncio.gather(*(one(client, prompt) for prompt in prompts))
        wall = time.monotonic() - started
    return {"tpot_ms": 1000 * statistics.median(tpots), "tokens_per_s": tokens / wall}


def acceptance(url: str) -> tuple[float, float]:
    """vLLM's counters: (accepted, proposed) speculative tokens so far."""
    import httpx

    totals = {"accepted": 0.0, "draft": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for key, series in (("accepted", "vllm:spec_decode_num_accepted_tokens_total"),
                            ("draft", "vllm:spec_decode_num_draft_tokens_total")):
            if line.startswith(series):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals["accepted"], totals["draft"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8", help="concurrency levels (comma-separated)")
    parser.add_argument("--requests", type=int, default=16, help="requests per level")
    parser.add_argument("--output", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--tokens", type=int, default=3, help="tokens the n-gram proposer proposes a step")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lmc.runtime.workers import free_port
    from lmc.testing.checkpoints import make_checkpoint

    prompts = [" ".join([PHRASES[i % len(PHRASES)]] * 4) for i in range(args.requests)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmc-spec-bench-") as tmp:
        root = Path(tmp)
        checkpoint = make_checkpoint("llama", root / "ckpt", dtype="bfloat16", **MODEL)
        top = max(levels)
        # Built with acceptance_rate 0.9 so that the artifact's plan keeps speculation on at every level measured
        # (at the default acceptance the planner turns it off at batch 8: this bench measures what that costs);
        # vLLM runs the same either way: the acceptance rate is a planning figure only.
        artifacts = {"ngram": build(root, "ngram", spec_text(checkpoint, args.output, top, args.tokens, 0.9)),
                     "none": build(root, "none", spec_text(checkpoint, args.output, top, None))}
        print(f"model: random Llama {MODEL}, bf16; {args.requests} requests of {args.output} tokens per level, "
              f"prompts of a phrase repeated 4 times; ngram proposing {args.tokens}; {os.cpu_count()} cores",
              flush=True)
        measured: dict[tuple[str, int], dict] = {}
        rates: dict[int, float] = {}
        for name, artifact in artifacts.items():
            before = uptime()
            with Runtime(artifact, free_port(), root / f"runtime-{name}.log") as served:
                asyncio.run(load(served.url, prompts[:2], 8, 2))  # warm-up
                for level in levels:
                    accepted0, draft0 = acceptance(served.url)
                    measured[(name, level)] = asyncio.run(load(served.url, prompts, args.output, level))
                    accepted, draft = acceptance(served.url)
                    if name == "ngram" and draft > draft0:
                        rates[level] = (accepted - accepted0) / (draft - draft0)
            print(f"{name}: served ({before} -> {uptime()})", flush=True)
        for level in levels:
            for name in ("none", "ngram"):
                got = measured[(name, level)]
                tokens = args.tokens if name == "ngram" else None
                plan = predicted(root, spec_text(checkpoint, args.output, level, tokens))
                row = {"speculation": name, "concurrency": level, "tpot_ms": round(got["tpot_ms"], 2),
                       "tokens_per_s": round(got["tokens_per_s"], 1), "planned_tpot_ms": plan["tpot_ms"],
                       "planned_tokens_per_s": plan["tokens_per_s"], "plan_keeps_it": plan["speculation"]}
                if name == "ngram" and level in rates:
                    rate = min(max(rates[level], 0.01), 0.99)
                    again = predicted(root, spec_text(checkpoint, args.output, level, tokens, rate))
                    row.update(measured_acceptance=round(rates[level], 3), planned_tpot_ms_at_it=again["tpot_ms"],
                               planned_tokens_per_s_at_it=again["tokens_per_s"])
                rows.append(row)
                extra = (f"; acceptance {row['measured_acceptance']} measured -> planned TPOT "
                         f"{row['planned_tpot_ms_at_it']} ms, {row['planned_tokens_per_s_at_it']} tokens/s"
                         if "measured_acceptance" in row else "")
                print(f"c={level:<3} {name:>5}: TPOT {row['tpot_ms']} ms (planned {row['planned_tpot_ms']}), "
                      f"{row['tokens_per_s']} tokens/s (planned {row['planned_tokens_per_s']}); plan keeps "
                      f"speculation: {row['plan_keeps_it']}{extra}", flush=True)
    for level in levels:
        plain, spec = measured[("none", level)], measured[("ngram", level)]
        print(f"c={level}: ngram / none: TPOT {spec['tpot_ms'] / plain['tpot_ms']:.2f}x, "
              f"throughput {spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
