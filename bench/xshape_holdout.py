"""How far aiconfigurator's cross-shape transfer is from a measurement: hold a measured MoE shape out of its data.

lmc opens aiconfigurator-core's database in its HYBRID mode with only the cross-shape transfer (planner/steps.py,
`AIC_DATABASE_MODE`, `AIC_TRANSFERS`), so a model whose expert shape its tables lack (GLM-4.7) is answered from the
nearest measured shape. This bench measures that transfer's error where the answer is known: for each model below it
copies aiconfigurator's vLLM data for a GPU (H100 by default) into a scratch folder, deletes the rows of that
model's own expert shape from its MoE tables (every vLLM version's), and compares the model's decode steps and
prefills on the copy (transferred) with those on the full data (measured). Nothing is fitted: the figures are
printed, per model, layout and step.

Usage:
    python bench/xshape_holdout.py [--system h100_sxm] [--batches 1,4,16,64] [--prompts 1024,4096]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SYSTEM, BACKEND, VERSION = "h100_sxm", "vllm", "0.24.0"
# (aiconfigurator's bundled model, its expert shape: experts, hidden, width, top-k; TP, expert parallel, quantization)
MODELS = [
    ("Qwen/Qwen3-235B-A22B", (128, 4096, 1536, 8), 8, True, "bfloat16"),
    ("Qwen/Qwen3-235B-A22B", (128, 4096, 1536, 8), 8, True, "fp8_block"),
    ("Qwen/Qwen3-30B-A3B", (128, 2048, 768, 8), 1, False, "bfloat16"),
    ("MiniMaxAI/MiniMax-M2.5", (256, 3072, 1536, 8), 8, True, "fp8_block"),
    ("mistralai/Mixtral-8x7B-v0.1", (8, 4096, 14336, 2), 2, False, "bfloat16"),
]


def handle(model: str, tp: int, ep: bool, quant: str, mode: str, systems: str | None, configs: Path,
           system: str = SYSTEM, version: str = VERSION):
    """aiconfigurator's engine for the layout, as lmc compiles it (steps._compile), on its database in `mode` read
    from `systems` (None: its own), the model's config written under `configs`."""
    from lmc.planner import catalog, steps

    facts = catalog.model_facts(model)  # the config lmc writes for it, or the one aiconfigurator bundles
    ref = str(steps._config_folder(configs, steps._bundled_config(facts.id) or steps.aic_config(facts)))
    args = {"tp_size": tp, "attention_dp_size": 1, "backend_version": version, "moe_tp_size": 1 if ep else tp,
            "moe_ep_size": tp if ep else 1, "gemm_quant_mode": "fp8" if quant == "fp8_block" else "bfloat16",
            "moe_quant_mode": quant}
    return steps._compile(ref, system, BACKEND, args, mode, systems)


def held_out_copy(root: Path, shape: tuple[int, int, int, int], system: str = SYSTEM, version: str = VERSION) -> str:
    """aiconfigurator's systems folder copied under `root` (its yaml files and `system`'s data), its vLLM MoE table
    for `system` without `shape`'s rows."""
    import pandas as pd

    from lmc.planner.steps import copy_systems

    # A folder per GPU and shape: aiconfigurator caches a database per systems folder.
    systems = root / system / "-".join(map(str, shape)) / "systems"
    if systems.exists():
        return str(systems)
    copy_systems(system, systems)
    # Every engine version's table: its database fills a shape the current one lacks from an older one's rows.
    experts, hidden, width, top_k = shape
    for table in (systems / "data" / system / "moe" / BACKEND).glob("*/moe_perf.parquet"):
        frame = pd.read_parquet(table)
        drop = ((frame.num_experts == experts) & (frame.hidden_size == hidden) & (frame.inter_size == width)
                & (frame.topk == top_k))
        frame[~drop].to_parquet(table)
    return str(systems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prompts", default="1024,4096")
    parser.add_argument("--system", default=SYSTEM,
                        help="aiconfigurator's GPU (h100_sxm, h200_sxm, a100_sxm, l40s, ...)")
    args = parser.parse_args()
    if importlib.util.find_spec("aiconfigurator_core") is None:
        print("aiconfigurator-core is not installed", file=sys.stderr)
        return 1
    logging.disable(logging.WARNING)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [int(p) for p in args.prompts.split(",")]
    from lmc.planner.steps import _backend_version

    system = args.system
    version = _backend_version(system, BACKEND)  # the data lmc plans with on that GPU
    ratios: list[float] = []
    print(f"{system}, {BACKEND} {version}: each model's expert shape held out of the MoE table; "
          "transferred / measured step time")
    print(f"{'model':30} {'TP':>3} {'EP':>3} {'experts':10} | "
          + " ".join(f"{'d' + str(b):>6}" for b in batches) + " | " + " ".join(f"{'p' + str(p):>6}" for p in prompts)
          + " | provenance")
    with tempfile.TemporaryDirectory() as scratch:
        for model, shape, tp, ep, quant in MODELS:
            try:
                measured = handle(model, tp, ep, quant, "SILICON", None, Path(scratch), system, version)
                measured.decode_step_latency(1, 1024, 1)
            except Exception as exc:  # not measured on this GPU: nothing to hold out
                print(f"{model:30} {tp:>3} {'yes' if ep else 'no':>3} {quant:10} | not measured: {str(exc)[:70]}")
                continue
            systems = held_out_copy(Path(scratch), shape, system, version)
            try:
                transferred = handle(model, tp, ep, quant, "HYBRID", systems, Path(scratch), system, version)
                row = [transferred.decode_step_latency(b, 1024, 1) / measured.decode_step_latency(b, 1024, 1)
                       for b in batches]
                tier = transferred.last_provenance()
                row += [transferred.predict_prefill_latency(1, p) / measured.predict_prefill_latency(1, p)
                        for p in prompts]
            except Exception as exc:  # no neighbour of the same kernel and quantization
                print(f"{model:30} {tp:>3} {'yes' if ep else 'no':>3} {quant:10} | no answer: {str(exc)[:80]}")
                continue
            ratios += row
            print(f"{model:30} {tp:>3} {'yes' if ep else 'no':>3} {quant:10} | "
                  + " ".join(f"{r:6.2f}" for r in row[:len(batches)]) + " | "
                  + " ".join(f"{r:6.2f}" for r in row[len(batches):]) + f" | {tier or 'measured'}")
    if ratios:
        errors = sorted(abs(r - 1) for r in ratios)
        print(f"\nall steps: median |transferred/measured - 1| {100 * statistics.median(errors):.1f} %, "
              f"worst {100 * errors[-1]:.1f} % (n={len(errors)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
