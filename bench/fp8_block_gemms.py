"""aiconfigurator-core's block-fp8 GEMM tables side by side: why lmc reads a block-fp8 checkpoint's GEMMs on vLLM from
another engine's table (lmc/planner/steps.py, GRAPH_TIMED_FP8_BLOCK).

Its vLLM collector times block-fp8 GEMMs eagerly and every other GEMM inside a CUDA graph
(collector/vllm/collect_gemm.py: `use_cuda_graph=gemm_type != "fp8_block"`); its SGLang and TensorRT-LLM collectors
time theirs (per-token-group quantization + DeepGEMM on Hopper and Blackwell) in a graph. For every GPU with
a vLLM fp8_block table, this prints, per band of token counts (m), the median ratio over the shapes both tables
have of:

    vLLM fp8_block / SGLang fp8_block        the eager launch, where it is large
    TensorRT-LLM fp8_block / SGLang fp8_block   two graph-timed collectors of the same kernel
    vLLM fp8 (per-tensor, graph-timed) / SGLang fp8_block

    python bench/fp8_block_gemms.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BANDS = [(1, 16), (17, 128), (129, 1024), (1025, 8192), (8193, 1 << 30)]


def table(folder: Path, dtype: str):
    import pandas as pd

    from lmc.planner.steps import _versions_newest_first

    versions = [name for name in _versions_newest_first(folder) if (folder / name / "gemm_perf.parquet").is_file()]
    if not versions:
        return None
    frame = pd.read_parquet(folder / versions[0] / "gemm_perf.parquet")  # the newest version, as lmc reads it
    frame = frame[frame.gemm_dtype == dtype]
    return frame.groupby(["m", "n", "k"]).latency.min() if len(frame) else None


def _median_ratio(band, column: str) -> str:
    """The median of `column` over the SGLang table's latency, over the band's shapes that have both."""
    return f"{(band[column] / band.donor).median():.2f}" if band[column].notna().any() else "—"


def main() -> int:
    import pandas as pd

    if importlib.util.find_spec("aiconfigurator_core") is None:
        print("fp8_block_gemms: aiconfigurator-core is not installed", file=sys.stderr)
        return 2
    from lmc.planner.steps import aic_systems_folder

    data = aic_systems_folder() / "data"
    print(f"{'GPU':<14} {'m':>12} {'shapes':>7} {'vLLM/SGLang':>12} {'TRT-LLM/SGLang':>15} {'vLLM fp8/SGLang':>16}")
    for gpu in sorted(path.name for path in data.iterdir()):
        gemm = data / gpu / "gemm"
        eager, donor = table(gemm / "vllm", "fp8_block"), table(gemm / "sglang", "fp8_block")
        if eager is None or donor is None:
            continue
        trt, per_tensor = table(gemm / "trtllm", "fp8_block"), table(gemm / "vllm", "fp8")
        joined = pd.concat({"eager": eager, "donor": donor, "trt": trt, "fp8": per_tensor}, axis=1).dropna(
            subset=["eager", "donor"])
        tokens = joined.index.get_level_values("m")
        for low, high in BANDS:
            band = joined[(tokens >= low) & (tokens <= high)]
            if band.empty:
                continue
            ratios = [_median_ratio(band, column) for column in ("eager", "trt", "fp8")]
            shown = f"{low}-{high}" if high < 1 << 30 else f">{low - 1}"
            print(f"{gpu:<14} {shown:>12} {len(band):>7} {ratios[0]:>12} {ratios[1]:>15} {ratios[2]:>16}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
