"""lmc's own step model beside aiconfigurator's measured data: the decode step and the prefill where both answer.

lmc plans from aiconfigurator-core's per-operation data wherever it has the GPU, the engine and the model
(planner/steps.py), and from its own model (latency.py) elsewhere: GPUs it has no data for, engines it does
not model, architectures it lacks (Gemma 3, docs/planner.md). This bench shows how far the second is from
the first where both exist, per layout, weight dtype and batch, so the own model's error on the targets it
alone serves can be judged from measured kernels rather than guessed. Nothing is fitted here.

`--implied-prefill`: per GPU the data cover (H100, H200, A100, L40S: one GPU, or NVLink), model, TP and prompt
length (4k and 8k tokens, where the prompt's FLOPs dominate), the share of peak TFLOPS (engines.toml's vLLM
`prefill_compute`, 0.45) at which the own model's prefill equals the data's, and the medians of the bf16 layouts,
dense and MoE apart (docs/known-gaps.md says why 0.45 stays although the data imply more).

Usage:
    python bench/own_model_vs_data.py [--context 1024] [--batches 1,4,16,64] [--prompts 1024,4096]
    python bench/own_model_vs_data.py --implied-prefill
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


# (GPU, catalog instance) and (model, TPs) of --implied-prefill: the GPUs aiconfigurator's vLLM data cover; L40S
# (PCIe, no NVLink) at one GPU only, so the prompt's compute is what the figure measures.
IMPLIED_GPUS = [("h100", "ml.p5.48xlarge"), ("h200", "ml.p5e.48xlarge"), ("a100", "ml.p4de.24xlarge"),
                ("l40s", "ml.g6e.48xlarge")]
IMPLIED_MODELS = [("meta-llama/Llama-3.1-8B", (1, 2)), ("meta-llama/Llama-3.1-70B", (4, 8)), ("Qwen/Qwen3-8B", (1,)),
                  ("Qwen/Qwen2.5-72B-Instruct", (4, 8)), ("Qwen/Qwen3-30B-A3B", (1, 2)),
                  ("mistralai/Mixtral-8x7B-v0.1", (2, 4)), ("Qwen/Qwen3-235B-A22B", (8,)), ("openai/gpt-oss-120b", (1, 4))]
IMPLIED_PROMPTS = (4096, 8192)


def implied_prefill() -> list[tuple]:
    """(GPU, model, TP, dtype, prompt, MoE?, share of peak) for every layout aiconfigurator's data answer: the
    prefill_compute at which lmc's own prefill of the prompt equals the data's (bisection; the own model's
    other terms, one weight read, all-reduces and fixed costs, as they are)."""
    from lmc.planner import catalog
    from lmc.planner.engines import engine_facts
    from lmc.planner.steps import MeasuredSteps, RooflineSteps, StepLayout, step_times

    vllm = engine_facts()["vllm"]
    gpu = vllm.efficiency["gpu"]
    out = []
    for name, instance in IMPLIED_GPUS:
        hardware = catalog.hardware_facts(instance)
        for model_id, tps in IMPLIED_MODELS:
            model = catalog.model_facts(model_id)
            dtypes = [model.checkpoint_quantization] if model.checkpoint_quantization else ["bf16"]
            for tp in tps:
                if name == "l40s" and tp > 1:
                    continue
                for dtype in dtypes:
                    layout = StepLayout("vllm", dtype, "bf16", tp)
                    measured = step_times(model, hardware, vllm, layout)
                    if not isinstance(measured, MeasuredSteps):
                        continue
                    for tokens in IMPLIED_PROMPTS:
                        data, low, high = measured.prefill_ms(tokens), 0.01, 2.0
                        for _ in range(40):
                            share = (low + high) / 2
                            # One share for the whole prompt, dense or MoE alike.
                            efficiency = gpu.model_copy(update={"prefill_compute": share})
                            engine = vllm.model_copy(update={"efficiency": {**vllm.efficiency, "gpu": efficiency}})
                            own = RooflineSteps(model, hardware, engine, layout, "implied").prefill_ms(tokens)
                            low, high = (share, high) if own > data else (low, share)
                        out.append((name, model_id, tp, dtype, tokens, model.num_experts > 1, (low + high) / 2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024, help="tokens each sequence holds (default %(default)s)")
    parser.add_argument("--batches", default="1,4,16,64", help="decode batches (default %(default)s)")
    parser.add_argument("--prompts", default="1024,4096", help="prefill lengths, one prompt (default %(default)s)")
    parser.add_argument("--implied-prefill", action="store_true",
                        help="the share of peak TFLOPS at which the own model's prefill equals the data's")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.implied_prefill:
        table = implied_prefill()
        print("share of peak TFLOPS at which lmc's own prefill equals aiconfigurator's data (vLLM)")
        for name, model_id, tp, dtype, tokens, moe, share in table:
            print(f"{name:5} {model_id:34} TP{tp} {dtype:6} {tokens:5} tokens {'MoE  ' if moe else 'dense'} {share:.2f}")
        for label, moe in (("dense", False), ("MoE", True)):
            shares = [row[6] for row in table if row[5] == moe and row[3] == "bf16"]
            quartiles = statistics.quantiles(shares, n=4)
            print(f"{label} bf16: median {statistics.median(shares):.2f}, quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}, "
                  f"range {min(shares):.2f}-{max(shares):.2f} (n={len(shares)})")
        return 0
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
