"""Compaction bench: decode throughput of one batch whose rows want different lengths, with rows
leaving the run as they finish (DecodeLoop.compact, the default) against keeping every row in the
forward until the longest is done (compact off), same model, same run.

Builds a small random Llama with `lmc build` (hf engine, fp32, TP=1, this CPU), loads it once with
the hf engine, and decodes --rows greedy rows (ignore_eos) whose max_new_tokens spread evenly from
--min-new to --max-new, alternately with compaction on and off, --runs times each. Tokens/s counts
the tokens the rows asked for over the wall time of the batch; the answers must be equal both ways.

No target: a figure for the record (the ideal is the ratio of row-steps, printed beside it; a small
model on a CPU pays a per-step cost whatever the rows, so it gets less).
Usage: python bench/compaction_bench.py [--rows 16] [--min-new 4] [--max-new 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SPEC = """\
[model]
id = "bench/small-llama"
path = "{path}"

[target]
instance = "local"

[workload]
max_input_tokens = 32
max_output_tokens = {max_new}
concurrency = {rows}

[pin]
engine = "hf"
dtype = "fp32"
tensor_parallel_degree = 1
replicas = 1
"""
DIMS = dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4)


def build(root: Path, args) -> Path:
    from lmc.cli.main import main
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", root / "ckpt", **DIMS)
    spec = root / "spec.toml"
    spec.write_text(SPEC.format(path=checkpoint.as_posix(), max_new=args.max_new, rows=args.rows))
    out = root / "artifact"
    if main(["build", str(spec), "--format", "dir", "-o", str(out)]) != 0:
        raise SystemExit("lmc build failed")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--min-new", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import torch

    from lmc.runtime.engines import create_engine
    from lmc.runtime.engines.base import GenerationParams, GenerationRequest

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="lmc-compaction-") as tmp:
        artifact = build(Path(tmp), args)
        plan = json.loads((artifact / "lmc.json").read_text())["plan"]
        engine = create_engine("hf", family="llama", task="text-generation", dtype="fp32", tensor_parallel_degree=1,
                               max_sequence_length=plan["max_sequence_length"], batch_size=args.rows, device="cpu")
        engine.load(artifact, 0, 1)
        step = (args.max_new - args.min_new) / max(args.rows - 1, 1)
        lengths = [round(args.min_new + i * step) for i in range(args.rows)]
        batch = [GenerationRequest(str(i), f"request {i}: the quick brown fox",
                                   GenerationParams(max_new_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]
        best = {True: 0.0, False: 0.0}
        answers = {}
        for _ in range(args.runs):
            for compact in (True, False):
                engine.loop.compact = compact
                start = time.perf_counter()
                results = engine.generate(batch)
                seconds = time.perf_counter() - start
                best[compact] = max(best[compact], sum(lengths) / seconds)
                answers[compact] = [r.token_ids for r in results]
                print(f"compact {'on ' if compact else 'off'}: {sum(lengths) / seconds:7.1f} tok/s", flush=True)
        if answers[True] != answers[False]:
            print("the answers differ with and without compaction", file=sys.stderr)
            return 1
        ideal = args.rows * max(lengths) / sum(lengths)
        print(json.dumps({"rows": args.rows, "max_new_tokens": [min(lengths), max(lengths)],
                          "compact_tok_s": round(best[True], 1), "full_batch_tok_s": round(best[False], 1),
                          "ratio": round(best[True] / best[False], 2), "ideal_ratio": round(ideal, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
