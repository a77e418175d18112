"""lmc's own step model beside aiconfigurator's measured data: the decode step and the prefill where both answer.

lmc plans from aiconfigurator-core's per-operation data wherever it has the GPU, the engine and the model
(planner/steps.py), and from its own model (latency.py) elsewhere: GPUs it has no data for, engines it does
not model, architectures it lacks (GLM-4.7, docs/fidelity.md). This bench shows how far the second is from
the first where both exist, per layout, weight dtype and batch, so the own model's error on the targets it
alone serves can be judged from measured kernels rather than guessed. Nothing is fitted here.

Usage:
    python bench/own_model_vs_data.py [--context 1024] [--batches 1,4,16,64] [--prompts 1024,4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (model, TP, expert parallel) on 8 x H100 (ml.p5.48xlarge); each in bf16 and, where the GPU computes in it, fp8
# (vLLM's online fp8; a quantized checkpoint keeps its own weights).
LAYOUTS = [("meta-llama/Llama-3.1-8B", 1, False), ("meta-llama/Llama-3.1-70B", 4, False),
           ("Qwen/Qwen3-30B-A3B", 1, False), ("Qwen/Qwen3-235B-A22B", 8, False), ("Qwen/Qwen3-235B-A22B", 8, True),
           ("mistralai/Mixtral-8x7B-v0.1", 2, False), ("openai/gpt-oss-120b", 1, False),
           ("deepseek-ai/DeepSeek-V3", 8, False), ("MiniMaxAI/MiniMax-M2.5", 8, True)]


def rows(context: int, batches: list[int], prompts: list[int]) -> list[tuple]:
    """Per layout and dtype: (model, TP, EP, dtype, [(batch, own, data)], [(prompt, own, data)], source); the
    lists are None where aiconfigurator's data do not answer."""
    from lmc.planner import catalog
    from lmc.planner.engines import engine_facts
    from lmc.planner.steps import MeasuredSteps, RooflineSteps, StepLayout, step_times

    vllm = engine_facts()["vllm"]
    h100 = catalog.hardware_facts("ml.p5.48xlarge")
    out = []
    for model_id, tp, ep in LAYOUTS:
        model = catalog.model_facts(model_id)
        dtypes = [model.checkpoint_quantization] if model.checkpoint_quantization else ["bf16", "fp8"]
        for dtype in dtypes:
            layout = StepLayout("vllm", dtype, "bf16", tp, 1, ep)
            measured = step_times(model, h100, vllm, layout)
            if not isinstance(measured, MeasuredSteps):
                out.append((model_id, tp, ep, dtype, None, None, measured.source))
                continue
            own = RooflineSteps(model, h100, vllm, layout, "compared")
            ratios = [(batch, own.decode_ms(batch, context), measured.decode_ms(batch, context)) for batch in batches]
            prefills = [(tokens, own.prefill_ms(tokens), measured.prefill_ms(tokens)) for tokens in prompts]
            out.append((model_id, tp, ep, dtype, ratios, prefills, measured.source))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024, help="tokens each sequence holds (default %(default)s)")
    parser.add_argument("--batches", default="1,4,16,64", help="decode batches (default %(default)s)")
    parser.add_argument("--prompts", default="1024,4096", help="prefill lengths, one prompt (default %(default)s)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [int(p) for p in args.prompts.split(",")]
    table = rows(args.context, batches, prompts)
    print(f"decode step on 8 x H100, context {args.context}: lmc's own model / aiconfigurator's data (ms)")
    _print(table, 4, [f"b{b}" for b in batches])
    print()
    print("prefill of one prompt on 8 x H100 (TTFT's steps, without the server): lmc's own model / aiconfigurator's "
          "data (ms)")
    _print(table, 5, [f"{p} tokens" for p in prompts])
    return 0


def _print(table: list[tuple], column: int, names: list[str]) -> None:
    print(f"{'model':34} {'TP':>2} {'EP':>2} {'dtype':6} " + " ".join(f"{name:>19}" for name in names))
    by_dtype: dict[str, list[float]] = {}
    for row in table:
        model_id, tp, ep, dtype, figures, source = row[0], row[1], row[2], row[3], row[column], row[6]
        cells = ("no data: " + source) if figures is None else " ".join(
            f"{own:7.2f}/{data:7.2f} {own / data:4.2f}" for _, own, data in figures)
        print(f"{model_id:34} {tp:>2} {'y' if ep else '-':>2} {dtype:6} {cells}")
        if figures:
            by_dtype.setdefault(dtype, []).extend(own / data for _, own, data in figures)
    for dtype, values in sorted(by_dtype.items()):
        print(f"{dtype}: own / data median {statistics.median(values):.2f}, range {min(values):.2f}-{max(values):.2f} "
              f"(n={len(values)})")


if __name__ == "__main__":
    raise SystemExit(main())
