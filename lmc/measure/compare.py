"""Predicted beside measured: the plan's model evaluated at each concurrency level a bench report ran,
with the bench's prompt and output lengths, against the report's figures. Pure (no torch, no I/O).

Per level c, with R replicas and the planned batch B, each replica decodes b = min(B, ceil(c / R))
sequences at a time (closed-loop clients arrive together, so dynamic batches fill):
- TPOT = the latency model's decode step at batch b;
- TTFT = the prefill of b prompts at once (the model's prefill of b · input tokens), plus the
  planned max_batch_delay when b is below the planned batch (dynamic batching waits that long for
  a batch to fill);
- end-to-end = TTFT + (output − 1) · TPOT;
- output throughput = min(c, R · B) · output / end-to-end;
- peak worker memory = the memory model's per-device total at batch b (on a CPU host, per TP rank).
A vLLM plan instead evaluates the plan's own serving model (planner/vllm.py `vllm_predict`, over the step
times the plan names in `predicted.step_times`) at each level: c clients over its replicas, the planned
max_num_seqs, token budget and KV cache dtype, the bench's lengths.
Latencies compare the measured p50. A figure is flagged when measured/predicted is off by more than
25 % either way (docs/measuring.md).
"""

from __future__ import annotations

import math
from typing import Any

from lmc.planner.facts import EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.plan import Plan

FLAG_PAST = 0.25
FIGURES = (  # (key, label, unit)
    ("ttft_ms", "TTFT p50", "ms"),
    ("tpot_ms", "TPOT p50", "ms"),
    ("e2e_ms", "E2E p50", "ms"),
    ("output_tokens_per_s", "output tokens/s", "tok/s"),
    ("peak_worker_memory_bytes", "peak worker memory", "MiB"),
)


def predict_level(plan: Plan, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, concurrency: int,
                  input_tokens: int, output_tokens: int) -> dict[str, float]:
    """The model's figures for one concurrency level (see the module docstring)."""
    from lmc.planner import latency
    from lmc.planner.latency import efficiency_for
    from lmc.planner.memory import memory_per_device

    batch = min(plan.batch_size, math.ceil(concurrency / plan.replicas))
    if plan.engine == "vllm" and plan.vllm is not None:
        return _vllm_level(plan, model, hardware, engine, concurrency, input_tokens, output_tokens, batch)
    args = (model, hardware, engine, plan.dtype, plan.tensor_parallel_degree)
    tpot = latency.tpot_ms(*args, batch, input_tokens, output_tokens)
    ttft = latency.ttft_ms(*args, input_tokens * batch)
    if batch < plan.batch_size and plan.max_batch_delay_ms:
        ttft += plan.max_batch_delay_ms  # a batch that does not fill waits the delay for company
    e2e = ttft + (output_tokens - 1) * tpot
    active = min(concurrency, plan.replicas * plan.batch_size)
    memory = memory_per_device(model, hardware, engine, efficiency_for(engine, model, hardware), plan.dtype,
                               plan.tensor_parallel_degree, batch, input_tokens, output_tokens, 1.0, None)
    return {"batch": batch, "ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e,
            "output_tokens_per_s": active * output_tokens / e2e * 1e3, "peak_worker_memory_bytes": memory.total}


def _vllm_level(plan: Plan, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, concurrency: int,
                input_tokens: int, output_tokens: int, batch: int) -> dict[str, float]:
    """A vLLM plan's own serving model at one level (its layout as planned, the bench's lengths)."""
    from lmc.planner.vllm import plan_layout, vllm_predict

    layout = plan_layout(plan, model, hardware)
    timing = vllm_predict(model, hardware, engine, plan.dtype, plan.tensor_parallel_degree, plan.replicas, layout,
                          input_tokens, output_tokens, concurrency)
    e2e = timing.ttft_ms + (output_tokens - 1) * timing.tpot_ms
    return {"batch": batch, "ttft_ms": timing.ttft_ms, "tpot_ms": timing.tpot_ms, "e2e_ms": e2e,
            "output_tokens_per_s": timing.throughput_tokens_per_s,
            "peak_worker_memory_bytes": plan.memory_per_device.total}


def _measured(level: dict[str, Any], key: str) -> float | None:
    value = level.get(key)
    if isinstance(value, dict):
        return value.get("p50")
    return value


def compare(plan: Plan, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts,
            report: dict[str, Any]) -> dict[str, Any]:
    """Rows of (level, figure, predicted, measured, ratio measured/predicted, flagged)."""
    workload = report["workload"]
    rows = []
    for level in report["levels"]:
        predicted = predict_level(plan, model, hardware, engine, level["concurrency"], workload["input_tokens"],
                                  workload["output_tokens"])
        for key, label, unit in FIGURES:
            measured = _measured(level, key)
            want = predicted[key]
            ratio = measured / want if measured is not None and want else None
            rows.append({"concurrency": level["concurrency"], "batch": predicted["batch"], "figure": key,
                         "label": label, "unit": unit, "predicted": want, "measured": measured,
                         "ratio": None if ratio is None else round(ratio, 4),
                         "flagged": ratio is not None and abs(ratio - 1) > FLAG_PAST})
    same_plan = report.get("plan_sha256") in (None, plan.plan_sha256)
    return {"plan_sha256": plan.plan_sha256, "bench_plan_sha256": report.get("plan_sha256"), "same_plan": same_plan,
            "step_times": plan.predicted.step_times,
            "workload": workload, "flag_past": FLAG_PAST, "rows": rows,
            "flagged": sum(row["flagged"] for row in rows)}


def _show(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "MiB":
        return f"{value / 2**20:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def render_comparison(result: dict[str, Any], spec_path: str, bench_path: str) -> str:
    workload = result["workload"]
    lines = [f"predicted ({spec_path}) vs measured ({bench_path}): {workload['input_tokens']} prompt tokens, "
             f"{workload['output_tokens']} output tokens; flagged past ±{result['flag_past']:.0%}"]
    if result.get("step_times"):
        lines.append(f"step times: {result['step_times']}")
    if not result["same_plan"]:
        lines.append(f"warning: the bench ran plan {str(result['bench_plan_sha256'])[:12]}, "
                     f"the spec plans {result['plan_sha256'][:12]}: figures may not be comparable")
    columns = ["conc", "batch", "figure", "unit", "predicted", "measured", "measured/pred", ""]
    table = [[str(row["concurrency"]), str(row["batch"]), row["label"], row["unit"], _show(row["predicted"], row["unit"]),
              _show(row["measured"], row["unit"]), "-" if row["ratio"] is None else f"{row['ratio']:.2f}",
              "OFF" if row["flagged"] else ""] for row in result["rows"]]
    widths = [max(len(c), *(len(r[i]) for r in table)) if table else len(c) for i, c in enumerate(columns)]
    lines.append("  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths))).rstrip())
    for row in table:
        lines.append("  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    lines.append(f"{result['flagged']} of {len(result['rows'])} figures off by more than {result['flag_past']:.0%}")
    return "\n".join(lines) + "\n"
