"""bench/vllm_server_parity.py without starting a server: which targets a summary misses (its exit status)."""

from __future__ import annotations

import pytest

try:
    from _scripts import load_script
except ImportError:  # tests/ imported as a package
    from tests._scripts import load_script


@pytest.fixture(scope="module")
def parity():
    return load_script("bench/vllm_server_parity.py")


def _row(model, concurrency, throughput_met, ttft_met, failures_met=None):
    return {"model": model, "concurrency": concurrency,
            "ratios": {"throughput_met": throughput_met, "ttft_p99_met": ttft_met, "no_failures_met": failures_met}}


def test_a_run_that_meets_every_target_misses_nothing(parity):
    assert parity.missed([_row("tiny", 16, True, True, True), _row("512", 128, True, True)]) == []


def test_each_missed_or_unjudged_target_is_named(parity):
    summary = [_row("tiny", 16, True, False, True), _row("512", 128, False, True),
               _row("512", 16, None, None, False)]  # failed requests: the ratios cannot be judged
    assert parity.missed(summary) == ["tiny c=16 TTFT p99", "512 c=128 throughput", "512 c=16 throughput",
                                      "512 c=16 TTFT p99", "512 c=16 no failed request"]


def test_each_server_goes_first_in_half_the_pairs(parity):
    """A B B A: the cost of going first (a drift of the host, a cold client) falls on both servers alike."""
    orders = [parity.pair_order(run) for run in range(4)]
    assert orders == [("lmc", "vllm"), ("vllm", "lmc"), ("lmc", "vllm"), ("vllm", "lmc")]
    assert sorted(order[0] for order in orders) == ["lmc", "lmc", "vllm", "vllm"]
