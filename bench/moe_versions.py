"""aiconfigurator-core's vLLM MoE tables of two engine versions side by side: how much of a published row's
per-token gap is the engine version the row ran, not lmc's model.

lmc plans with aiconfigurator's current vLLM tables (0.24.0 for H100 and H200; lmc deploys a newer vLLM still).
Published rows ran older engines: the gpt-oss-20b rows of bench/data/fidelity.csv ran vLLM 0.19.1 on an H100, and
lmc is 19-31 % under their TPOT there while it is within 6 % of the same post's Llama-3.1-8B rows. aiconfigurator
keeps older tables where it collected them (H200 and B200: vLLM 0.19.0 beside 0.24.0; not queryable through its
version slots, systems/query_versions.yaml, only kept as backward fill). For every GPU with two vLLM MoE versions
this prints, per MoE dtype and band of token counts, the median ratio older / newer latency over the shapes
(hidden, intermediate, experts, top-k, TP, EP) both tables have, on the power-law routing aiconfigurator's model
reads by default; then one shape's latencies at decode-sized token counts in both, and their difference per MoE
layer (default: gpt-oss-20b's 2880 x 2880, 32 experts, top 4, one rank).

    python bench/moe_versions.py [--shape HIDDEN,INTER,EXPERTS,TOPK[,TP,EP]] [--gpu h200_sxm]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

BANDS = [(1, 8), (9, 64), (65, 512), (513, 1 << 30)]
DISTRIBUTION = "power_law_1.2"
SHAPE_COLUMNS = ["hidden_size", "inter_size", "num_experts", "topk", "moe_tp_size", "moe_ep_size"]
DECODE_TOKENS = (1, 2, 4, 8, 16, 32)


def versions(folder: Path) -> list[str]:
    """The engine versions with a MoE table under one GPU's moe/vllm folder, newest first."""
    from lmc.planner.steps import _versions_newest_first

    return [name for name in _versions_newest_first(folder) if (folder / name / "moe_perf.parquet").is_file()]


def latencies(table):
    """One latency per (dtype, shape, tokens) on DISTRIBUTION: the fastest where a table repeats a key."""
    rows = table[table.distribution == DISTRIBUTION]
    return rows.groupby(["moe_dtype", *SHAPE_COLUMNS, "num_tokens"]).latency.min()


def band_ratios(older, newer) -> list[tuple[str, str, int, float]]:
    """(dtype, band, keys, median older / newer) over the keys both series have, per dtype and token band."""
    import pandas as pd

    joined = pd.concat({"older": older, "newer": newer}, axis=1).dropna()
    out = []
    for dtype, group in joined.groupby(level="moe_dtype"):
        tokens = group.index.get_level_values("num_tokens")
        for low, high in BANDS:
            band = group[(tokens >= low) & (tokens <= high)]
            if len(band):
                shown = f"{low}-{high}" if high < 1 << 30 else f">{low - 1}"
                out.append((dtype, shown, len(band), float((band.older / band.newer).median())))
    return out


def shape_rows(older, newer, shape: tuple[int, ...]) -> list[tuple[str, int, float, float]]:
    """(dtype, tokens, older µs, newer µs) for one shape at decode-sized token counts, where both tables have it."""
    out = []
    for dtype in sorted(set(older.index.get_level_values("moe_dtype")) & set(newer.index.get_level_values("moe_dtype"))):
        for tokens in DECODE_TOKENS:
            key = (dtype, *shape, tokens)
            if key in older.index and key in newer.index:
                out.append((dtype, tokens, float(older[key]) * 1e3, float(newer[key]) * 1e3))
    return out


def parse_shape(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(","))
    if len(values) == 4:
        values += (1, 1)
    if len(values) != 6:
        raise argparse.ArgumentTypeError("HIDDEN,INTER,EXPERTS,TOPK[,TP,EP]")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=parse_shape, default=(2880, 2880, 32, 4, 1, 1),
                        help="HIDDEN,INTER,EXPERTS,TOPK[,TP,EP] (default: gpt-oss-20b's on one rank)")
    parser.add_argument("--gpu", help="only this aiconfigurator system (h200_sxm, b200_sxm, ...)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("aiconfigurator_core") is None:
        print("moe_versions: aiconfigurator-core is not installed", file=sys.stderr)
        return 2
    import pandas as pd

    from lmc.planner.steps import aic_systems_folder

    data = aic_systems_folder() / "data"
    print(f"{'GPU':<12} {'older/newer':<16} {'dtype':<12} {'tokens':>8} {'keys':>6} {'ratio':>6}")
    pairs = []
    for gpu in sorted(path.name for path in data.iterdir() if not args.gpu or path.name == args.gpu):
        folder = data / gpu / "moe" / "vllm"
        found = versions(folder) if folder.is_dir() else []
        newer = latencies(pd.read_parquet(folder / found[0] / "moe_perf.parquet")) if len(found) > 1 else None
        for old in found[1:]:
            older = latencies(pd.read_parquet(folder / old / "moe_perf.parquet"))
            pairs.append((gpu, old, found[0], older, newer))
            for dtype, band, keys, ratio in band_ratios(older, newer):
                print(f"{gpu:<12} {old + '/' + found[0]:<16} {dtype:<12} {band:>8} {keys:>6} {ratio:>6.2f}")
    shape = ",".join(str(value) for value in args.shape)
    print(f"\nshape {shape} (hidden, inter, experts, top-k, TP, EP), {DISTRIBUTION}, µs per MoE layer")
    print(f"{'GPU':<12} {'older/newer':<16} {'dtype':<12} {'tokens':>6} {'older':>8} {'newer':>8} {'diff':>7}")
    for gpu, old, new, older, newer in pairs:
        for dtype, tokens, then, now in shape_rows(older, newer, args.shape):
            print(f"{gpu:<12} {old + '/' + new:<16} {dtype:<12} {tokens:>6} {then:>8.1f} {now:>8.1f} {then - now:>+7.1f}")
    if not pairs:
        print("moe_versions: no GPU has two vLLM MoE table versions", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
