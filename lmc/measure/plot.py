"""`lmc bench --plot`: latency and throughput against concurrency, measured and (with a spec) predicted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmc.errors import MissingDependencyError


def plot_report(report: dict[str, Any], comparison: dict[str, Any] | None, out: Path) -> None:
    """Three panels: TTFT and TPOT (p50, with p90 as a band's upper edge), output throughput. Dashed
    lines are the plan's predictions at the same levels."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("--plot needs matplotlib: pip install 'lmc[bench]'") from None
    levels = report["levels"]
    x = [level["concurrency"] for level in levels]
    predicted: dict[str, dict[int, float]] = {}
    for row in (comparison or {}).get("rows", []):
        predicted.setdefault(row["figure"], {})[row["concurrency"]] = row["predicted"]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        p50 = [(level[key] or {}).get("p50") for level in levels]
        p90 = [(level[key] or {}).get("p90") for level in levels]
        ax.plot(x, p50, "o-", label="measured p50")
        ax.plot(x, p90, "^:", color="tab:blue", alpha=0.6, label="measured p90")
        if key in predicted:
            ax.plot(x, [predicted[key].get(c) for c in x], "s--", color="tab:orange", label="predicted")
        ax.set_title(title)
    throughput = [level["output_tokens_per_s"] for level in levels]
    axes[2].plot(x, throughput, "o-", label="measured")
    if "output_tokens_per_s" in predicted:
        axes[2].plot(x, [predicted["output_tokens_per_s"].get(c) for c in x], "s--", color="tab:orange", label="predicted")
    axes[2].set_title("output throughput (tokens/s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.set_xlabel("concurrency")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    workload = report["workload"]
    note = "" if comparison else " (no --spec: predictions not drawn)"
    figure.suptitle(f"lmc bench {report['target']}: {workload['input_tokens']} in / {workload['output_tokens']} out, "
                    f"{report['measured_at']}{note}", fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
