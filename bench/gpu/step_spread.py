"""The hf engine's per-token cost measured as `lmc calibrate` measures it, on its calibration models and on a
wider one, to see whether the calibrated fixed costs predict the wider model's served steps.

`lmc calibrate` takes the engine's fixed costs from two tiny models (2 and 12 layers, 64 wide) served by
`lmc runtime` at batch 1: per token = (end-to-end of 32 tokens − of 2) / 30, each the fastest of 5. This
prints every sample's per-token figure (fastest, median, slowest) for the tiny models, then for a Llama of
`--layers` layers at Llama-2-7B's width (fp16 on a GPU), then the tiny models again (the host's drift over
the run), and what step + layers × layer predicts from the fastest and from the median samples.

Usage (a GPU host; `--device cpu` runs it small here): python bench/gpu/step_spread.py [--layers 8] [--requests 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def drive(root: Path, name: str, made: bool, dtype: str, layers: int, width: dict, target: str, device: str,
          requests: int) -> dict:
    """One model served as `lmc calibrate` serves its fixed-cost models (calibrate.serve_and_drive): `requests`
    of 32 and of 2 tokens at batch 1; per token from the end-to-end times, fastest, median and slowest."""
    from lmc.measure.calibrate import serve_and_drive

    run = serve_and_drive(root, name, dtype, layers, width, target, device, 16,
                          [("long", 32, 1, requests), ("short", 2, 1, requests)], made=made)
    long_e2e = sorted(s.e2e_s * 1e3 for s in run.samples["long"])
    short_e2e = sorted(s.e2e_s * 1e3 for s in run.samples["short"])
    tpot = sorted(s.tpot_s * 1e3 for s in run.samples["long"])
    row = {"name": name, "layers": layers,
           "per_token_fastest": (long_e2e[0] - short_e2e[0]) / 30,
           "per_token_median": (statistics.median(long_e2e) - statistics.median(short_e2e)) / 30,
           "per_token_slowest": (long_e2e[-1] - short_e2e[-1]) / 30,
           "stream_tpot_min": tpot[0], "stream_tpot_median": statistics.median(tpot), "stream_tpot_max": tpot[-1],
           "long_e2e_ms": [round(x, 2) for x in long_e2e], "short_e2e_ms": [round(x, 2) for x in short_e2e]}
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=7)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    gpu = args.device == "cuda"
    if gpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_loop import LLAMA_7B, LoopError, accelerator_for, require_cuda, write_checkpoint
        try:
            accelerator = accelerator_for(require_cuda())
        except LoopError as error:
            print(str(error).replace("gpu_loop:", "step_spread:", 1), file=sys.stderr)
            return 1
        target = f'accelerator = "{accelerator}"\ndevices = 1'
        wide, wide_dtype = dict(LLAMA_7B), "fp16"
    else:
        target = 'instance = "local"'
        wide, wide_dtype = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                                num_key_value_heads=8), "fp32"
    wide.pop("num_hidden_layers", None)
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmc-step-spread-") as tmp:
        root = Path(tmp)
        for rnd in ("before", "after"):
            for layers in (2, 12):
                rows.append(dict(drive(root, f"tiny{layers}-{rnd}", False, "fp32", layers, {}, target, args.device,
                                       args.requests), round=rnd))
            if rnd == "before":
                name = "wide"
                if gpu:
                    write_checkpoint(root / f"checkpoint-{name}", args.layers)
                rows.append(dict(drive(root, name, gpu, wide_dtype, args.layers, wide, target, args.device,
                                       args.requests), round="wide"))
    from lmc.measure.calibrate import fixed_costs

    by = {(r["round"], r["layers"]): r for r in rows if r["name"].startswith("tiny")}
    wide_row = next(r for r in rows if r["name"] == "wide")
    print(f"\n{time.perf_counter() - start:.0f} s")
    for rnd in ("before", "after"):
        e2e = {n: (by[(rnd, n)]["long_e2e_ms"], by[(rnd, n)]["short_e2e_ms"]) for n in (2, 12)}
        # calibrate's own derivation, from the median runs (what it takes) and from the fastest (what it took)
        for stat, runs in (("fastest", {n: ([min(long)], [min(short)]) for n, (long, short) in e2e.items()}),
                           ("median", e2e)):
            step, layer, _ = fixed_costs(runs)
            print(f"tiny models {rnd}, {stat}: step {step:.2f} ms + {layer:.3f} ms/layer -> {args.layers} layers "
                  f"{step + args.layers * layer:.2f} ms (wide model served: fastest {wide_row['per_token_fastest']:.2f}, "
                  f"median {wide_row['per_token_median']:.2f}, stream TPOT median {wide_row['stream_tpot_median']:.2f})")
    Path(args.out, "step_spread.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
