"""bench/xshape_holdout.py: the shape it holds out is gone from the copy it reads, so what it prints is a transfer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("xshape_bench", REPO / "bench" / "xshape_holdout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_held_out_shape_is_answered_by_a_transfer_and_only_it_is_missing(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("aiconfigurator_core")
    bench = _load_bench()
    model, shape, tp, ep, quant = bench.MODELS[0]  # Qwen3-235B-A22B's 128 x 4096 x 1536 experts, top 8
    systems = Path(bench.held_out_copy(tmp_path, shape))
    table = systems / "data" / bench.SYSTEM / "moe" / bench.BACKEND / bench.VERSION / "moe_perf.parquet"
    kept = pd.read_parquet(table)
    original = pd.read_parquet(Path(importlib.util.find_spec("aiconfigurator_core").origin).parent / "systems"
                               / "data" / bench.SYSTEM / "moe" / bench.BACKEND / bench.VERSION / "moe_perf.parquet")
    shapes = (kept.num_experts == 128) & (kept.hidden_size == 4096) & (kept.inter_size == 1536) & (kept.topk == 8)
    assert not shapes.any() and 0 < len(original) - len(kept) < len(original) / 5
    measured = bench.handle(model, tp, ep, quant, "SILICON", None, tmp_path)
    transferred = bench.handle(model, tp, ep, quant, "HYBRID", str(systems), tmp_path)
    step = transferred.decode_step_latency(16, 1024, 1)
    assert transferred.last_provenance() == "xshape"
    assert step != measured.decode_step_latency(16, 1024, 1) and measured.last_provenance() is None
    # Its measured data alone cannot answer the held-out shape: the copy is what the transfer had to work from.
    with pytest.raises(Exception, match="MoE data missing"):
        bench.handle(model, tp, ep, quant, "SILICON", str(systems), tmp_path).decode_step_latency(16, 1024, 1)
