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


METRICS = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 90.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="m"} 98.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="m"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="m"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.25",model_name="m"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="2.5",model_name="m"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 100.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
"""


def test_the_servers_own_ttft_p99_is_read_from_its_histogram_between_two_scrapes(parity):
    """vLLM's TTFT histogram, summed over its engines: the p99 of the requests counted between two scrapes is
    the bound of the bucket that holds it; nothing counted, nothing to say."""
    after = parity.ttft_buckets(METRICS)
    assert after == {0.1: 190.0, 0.25: 198.0, 2.5: 200.0, float("inf"): 200.0}
    assert parity.bucket_quantile({}, after, 0.99) == 0.25  # 198 of 200 within 0.25 s
    assert parity.bucket_quantile({}, after, 0.995) == 2.5  # the last 2 above it
    assert parity.bucket_quantile({}, after, 0.95) == 0.1 and parity.bucket_quantile({}, after, 0.951) == 0.25
    before = {0.1: 100.0, 0.25: 100.0, 2.5: 100.0, float("inf"): 100.0}
    assert parity.bucket_quantile(before, after, 0.90) == 0.1  # of the 100 since: 90 within 0.1 s, 8 more by 0.25 s
    assert parity.bucket_quantile(before, after, 0.91) == 0.25 and parity.bucket_quantile(before, after, 0.99) == 2.5
    assert parity.bucket_quantile(after, after, 0.99) is None
