"""The latency model against published measurements (validation.toml): each prediction, its error,
and the summary docs/planner.md prints and tests/test_planner_latency.py holds to its bounds.

`python -m lmc.planner.validation` prints the table in docs/planner.md's format.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

from lmc.planner.engines import Measurement, engine_facts, measurements
from lmc.planner.latency import tpot_ms, ttft_ms

Metric = Literal["tpot", "ttft"]


@dataclass(frozen=True)
class Check:
    """One published figure beside the model's prediction for the same configuration."""

    measurement: Measurement
    metric: Metric
    measured_ms: float
    predicted_ms: float

    @property
    def error(self) -> float:
        """Signed relative error: +0.10 is a prediction 10% slower than the measurement."""
        return self.predicted_ms / self.measured_ms - 1


@dataclass(frozen=True)
class Summary:
    metric: Metric
    role: str
    count: int
    median_abs_error: float
    worst_abs_error: float


def checks() -> tuple[Check, ...]:
    """Every published TPOT and TTFT in validation.toml with the model's prediction, in file order."""
    engines = engine_facts()
    out = []
    for m in measurements():
        # The published rows measure fused-kernel systems: they hold DeepSpeed's fused figures to account
        # whether or not lmc's runtime can inject the kernels today.
        engine = engines[m.engine].model_copy(update={"kernel_injection": True})
        tp = m.tensor_parallel_degree
        if m.measured_tpot_ms is not None:
            predicted = tpot_ms(m.model, m.hardware, engine, m.dtype, tp, m.batch_size, m.input_tokens, m.output_tokens)
            out.append(Check(m, "tpot", m.measured_tpot_ms, predicted))
        if m.measured_ttft_ms is not None:
            predicted = ttft_ms(m.model, m.hardware, engine, m.dtype, tp, m.input_tokens)
            out.append(Check(m, "ttft", m.measured_ttft_ms, predicted))
    return tuple(out)


def summarize(rows: tuple[Check, ...], metric: Metric, role: str = "all") -> Summary:
    """Median and worst absolute error of one metric, over every row or one role's."""
    errors = [abs(c.error) for c in rows if c.metric == metric and role in ("all", c.measurement.role)]
    return Summary(metric, role, len(errors), statistics.median(errors), max(errors))


def markdown_table(rows: tuple[Check, ...] | None = None) -> str:
    """The validation table and its summary lines, as docs/planner.md carries them."""
    rows = checks() if rows is None else rows
    lines = ["| role | metric | measurement | system | hardware | lmc engine, dtype, TP, batch, in/out tokens "
             "| measured | predicted | error |",
             "|---|---|---|---|---|---|---:|---:|---:|"]
    for c in rows:
        m = c.measurement
        config = (f"{m.engine} {m.dtype} TP{m.tensor_parallel_degree} b{m.batch_size}, "
                  f"{m.input_tokens}/{m.output_tokens}")
        lines.append(f"| {m.role} | {c.metric.upper()} | {m.name} | {m.system or '—'} | {m.hardware.name} | {config} "
                     f"| {c.measured_ms:.2f} ms | {c.predicted_ms:.2f} ms | {c.error * 100:+.1f}% |")
    lines.append("")
    for metric in ("tpot", "ttft"):
        for role in ("all", "validation", "calibration"):
            s = summarize(rows, metric, role)
            lines.append(f"- {metric.upper()}, {role} rows ({s.count}): median |error| "
                         f"{s.median_abs_error * 100:.1f}%, worst {s.worst_abs_error * 100:.1f}%")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
