"""bench/moe_versions.py: its ratios and per-layer differences are over the keys both versions' tables share."""

from __future__ import annotations

import pytest

try:
    from _scripts import load_script
except ImportError:  # tests/ imported as a package
    from tests._scripts import load_script


def _load_bench():
    return load_script("bench/moe_versions.py")


def _table(pd, rows):
    columns = ["moe_dtype", "hidden_size", "inter_size", "num_experts", "topk", "moe_tp_size", "moe_ep_size",
               "num_tokens", "distribution", "latency"]
    return pd.DataFrame(rows, columns=columns)


def test_ratios_pair_only_shared_keys_on_power_law_routing_and_take_the_fastest_repeat():
    pd = pytest.importorskip("pandas")
    bench = _load_bench()
    shape = (2880, 2880, 32, 4, 1, 1)
    older = _table(pd, [("w4a16_mxfp4", *shape, 1, "power_law_1.2", 0.090),
                        ("w4a16_mxfp4", *shape, 1, "power_law_1.2", 0.080),  # a repeat: the fastest is kept
                        ("w4a16_mxfp4", *shape, 8, "power_law_1.2", 0.150),
                        ("w4a16_mxfp4", *shape, 8, "balanced", 0.900),  # another routing: not compared
                        ("w4a16_mxfp4", *shape, 16, "power_law_1.2", 0.300),  # the newer table lacks it
                        ("bfloat16", *shape, 1, "power_law_1.2", 0.050)])
    newer = _table(pd, [("w4a16_mxfp4", *shape, 1, "power_law_1.2", 0.040),
                        ("w4a16_mxfp4", *shape, 8, "power_law_1.2", 0.100),
                        ("w4a16_mxfp4", *shape, 8, "balanced", 0.100),
                        ("bfloat16", *shape, 1, "power_law_1.2", 0.050),
                        ("bfloat16", *shape, 100, "power_law_1.2", 0.500)])  # the older table lacks it
    old, new = bench.latencies(older), bench.latencies(newer)
    ratios = {(dtype, band): (keys, ratio) for dtype, band, keys, ratio in bench.band_ratios(old, new)}
    # 0.080 / 0.040 and 0.150 / 0.100: median 1.75 over the two shared decode-sized keys.
    assert ratios == {("bfloat16", "1-8"): (1, pytest.approx(1.0)), ("w4a16_mxfp4", "1-8"): (2, pytest.approx(1.75))}
    rows = bench.shape_rows(old, new, shape)
    assert [(dtype, tokens) for dtype, tokens, _, _ in rows] == [("bfloat16", 1), ("w4a16_mxfp4", 1),
                                                                 ("w4a16_mxfp4", 8)]
    assert rows[1][2:] == (pytest.approx(80.0), pytest.approx(40.0))


def test_a_shape_names_four_or_six_numbers():
    bench = _load_bench()
    assert bench.parse_shape("2880,2880,32,4") == (2880, 2880, 32, 4, 1, 1)
    assert bench.parse_shape("3072,1536,256,8,1,8") == (3072, 1536, 256, 8, 1, 8)
    with pytest.raises(Exception, match="HIDDEN"):
        bench.parse_shape("2880,2880")
