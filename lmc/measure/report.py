"""The bench report: samples per concurrency level summarised (p50/p90/p99), as JSON and as a table.
Pure: samples in, a dict and text out.

The JSON (`lmc bench --json OUT`), all times in milliseconds, memory in bytes:
{"lmc_version", "kind": "lmc-bench", "format_version": 1, "target", "plan_sha256" (null for a URL),
 "plan": {engine, dtype, tensor_parallel_degree, replicas, batch_size} or null, "measured_at", "host",
 "workload": {"input_tokens", "output_tokens"}, "memory_source",
 "levels": [{"concurrency", "requests", "errors", "wall_s", "ttft_ms": {p50, p90, p99, mean},
             "tpot_ms": {...}, "e2e_ms": {...}, "output_tokens_per_s", "peak_worker_memory_bytes"}],
 "peak_worker_memory_bytes", "workers": [{"pid", "peak_bytes"}]}
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lmc.measure.loadgen import Sample

FORMAT_VERSION = 1


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": round(percentile(values, 50), 3), "p90": round(percentile(values, 90), 3),
            "p99": round(percentile(values, 99), 3), "mean": round(sum(values) / len(values), 3)}


def level_report(concurrency: int, samples: list[Sample], wall_s: float, peak_memory: int | None,
                 output_tokens: int) -> dict[str, Any]:
    """One concurrency level's figures. Requests that failed, or came back shorter than asked, are
    counted as errors and left out of the latency figures."""
    def ok(sample: Sample) -> bool:
        return sample.error is None and sample.completion_tokens == output_tokens

    good = [s for s in samples if ok(s)]
    errors = [s.error or f"{s.completion_tokens} tokens instead of {output_tokens}" for s in samples if not ok(s)]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall_s, 6),
        "ttft_ms": summary([s.ttft_s * 1e3 for s in good]),
        "tpot_ms": summary([s.tpot_s * 1e3 for s in good if s.tpot_s is not None]),
        "e2e_ms": summary([s.e2e_s * 1e3 for s in good]),
        "output_tokens_per_s": round(sum(s.completion_tokens for s in good) / wall_s, 3) if wall_s > 0 else None,
        # Below 1, streamed text came in fewer pieces than tokens (held-back bytes): TTFT and TPOT blur.
        "chunks_per_token": round(sum(s.chunks for s in good) / max(sum(s.completion_tokens for s in good), 1), 3)
        if good else None,
        "peak_worker_memory_bytes": peak_memory,
    }


def bench_report(*, lmc_version: str, target: str, plan: dict[str, Any] | None, measured_at: str, host: str,
                 input_tokens: int, output_tokens: int, levels: list[dict[str, Any]], memory_source: str | None,
                 workers: dict[int, int]) -> dict[str, Any]:
    return {
        "kind": "lmc-bench",
        "format_version": FORMAT_VERSION,
        "lmc_version": lmc_version,
        "target": target,
        "plan_sha256": plan.get("plan_sha256") if plan else None,
        "plan": {key: plan.get(key) for key in ("engine", "dtype", "tensor_parallel_degree", "replicas", "batch_size")}
        if plan else None,
        "measured_at": measured_at,
        "host": host,
        "workload": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        "memory_source": memory_source,
        "levels": levels,
        "peak_worker_memory_bytes": max(workers.values()) if workers else None,
        "workers": [{"pid": pid, "peak_bytes": size} for pid, size in sorted(workers.items())],
    }


# The figures every level of a run must have: a level without one measured nothing there.
LEVEL_FIGURES = ("ttft_ms", "tpot_ms", "e2e_ms", "output_tokens_per_s")


def bench_failure(report: dict[str, Any]) -> str | None:
    """Why the run is a failed bench, in one line: requests that failed (or came back short), or a level
    missing a figure; None when every request completed and every level has every figure. `lmc bench`
    exits non-zero with it, so a run where requests failed never passes for a measurement."""
    levels = report["levels"]
    failed = [level for level in levels if level["errors"]]
    if failed:
        total = sum(level["requests"] for level in levels)
        first = failed[0]
        return (f"{sum(level['errors'] for level in failed)} of {total} requests failed (first, at concurrency "
                f"{first['concurrency']}: {first['first_error']})")
    for level in levels:
        missing = [key for key in LEVEL_FIGURES if level.get(key) is None]
        if missing:
            return f"concurrency {level['concurrency']}: no {', '.join(missing)} measured"
    return None if levels else "no concurrency level ran"


def _cell(stats: dict[str, float] | None) -> str:
    return "-" if stats is None else f"{stats['p50']:.1f} / {stats['p90']:.1f} / {stats['p99']:.1f}"


def render_table(report: dict[str, Any]) -> str:
    """The report as a fixed-width table, one row per concurrency level."""
    workload = report["workload"]
    header = (f"lmc bench {report['target']}: {workload['input_tokens']} prompt tokens, "
              f"{workload['output_tokens']} output tokens; {report['measured_at']}; {report['host']}")
    columns = ["conc", "reqs", "err", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99", "E2E ms p50/p90/p99",
               "out tok/s", "peak worker MiB"]
    rows = []
    for level in report["levels"]:
        memory = level["peak_worker_memory_bytes"]
        rows.append([str(level["concurrency"]), str(level["requests"]), str(level["errors"]), _cell(level["ttft_ms"]),
                     _cell(level["tpot_ms"]), _cell(level["e2e_ms"]),
                     "-" if level["output_tokens_per_s"] is None else f"{level['output_tokens_per_s']:.1f}",
                     "-" if memory is None else f"{memory / 2**20:.0f}"])
    widths = [max(len(column), *(len(row[i]) for row in rows)) if rows else len(column)
              for i, column in enumerate(columns)]
    lines = [header, "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    if report["peak_worker_memory_bytes"] is not None:
        lines.append(f"peak worker memory over the run: {report['peak_worker_memory_bytes'] / 2**20:.0f} MiB "
                     f"({report['memory_source']})")
    for level in report["levels"]:
        if level.get("chunks_per_token") is not None and level["chunks_per_token"] < 0.9:
            lines.append(f"concurrency {level['concurrency']}: {level['chunks_per_token']:.2f} streamed chunks per token: "
                         "the server held text back, so TTFT and TPOT are not per token (give --tokenizer)")
        if level["first_error"]:
            lines.append(f"concurrency {level['concurrency']}: {level['errors']} failed; first: {level['first_error']}")
    return "\n".join(lines) + "\n"
