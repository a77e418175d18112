"""A finite benchmark run (lmc/planner/benchmark_run.py): the first `concurrency` prompts arrive together, vLLM's
scheduler serves decodes first and then prompt chunks in arrival order within the token budget; figures checked
against hand-derived ones with step times that are constants."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lmc.planner import catalog
from lmc.planner.benchmark_run import burst, vllm_benchmark_run
from lmc.planner.engines import engine_facts
from lmc.planner.vllm import VllmLayout, vllm_predict

VLLM = engine_facts()["vllm"]
QWEN8 = catalog.model_facts("Qwen/Qwen3-8B")
H100 = catalog.hardware_facts("ml.p5.48xlarge")


@dataclass(frozen=True)
class ConstantSteps:
    """Every step that reads prompt tokens costs 100 ms, a decode-only step 20 ms."""

    source: str = "constant"

    def prefill_ms(self, tokens: int) -> float:
        return 100.0

    def decode_ms(self, batch: int, context: int) -> float:
        return 20.0

    def mixed_ms(self, chunk: int, batch: int, prompt: int, context: int) -> float:
        return 100.0


LAYOUT = VllmLayout(block_size=16, blocks=100_000, bytes_per_block=1, pool_bytes=100_000, max_num_seqs=4,
                    max_model_len=4096 + 11, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                    cpu_kvcache_space_gib=None)


def test_a_burst_of_prompts_is_prefilled_in_arrival_order_behind_the_answered_prompts_decodes():
    # 4 prompts of 4096 tokens, budget 8192: step 0 reads prompts 0 and 1 (8192 tokens); step 1 reads 8190
    # (two decodes go first), finishing prompt 2 and 8190 − 4096 = 4094 tokens of prompt 3; step 2 its last 2.
    wave = burst(ConstantSteps(), 4, 4096, 8192)
    assert wave.first_step == [0, 0, 1, 2]
    assert wave.first_token_ms == [100.0, 100.0, 200.0, 300.0]
    assert wave.step_ms == [100.0, 100.0, 100.0]


def test_a_run_of_as_many_prompts_as_clients_is_the_burst_and_its_decodes():
    steps = ConstantSteps()
    run = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 4, steps)
    efficiency = VLLM.efficiency["gpu"]
    server = efficiency.request_overhead_ms + efficiency.tokenize_us_per_token * 4096 * 1e-3
    # Steady state (vllm_predict): a decode step plus 4 prompts per 11 steps at (100 − 20) ms per whole prompt.
    steady = 20 + 4 / 11 * 80
    assert vllm_predict(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, steps).tpot_ms == pytest.approx(steady)
    # 10 gaps each. The first request leaves at step 0 + 10; until then decodes of all 4 (20 ms), after it steady.
    # Prompts 0 and 1 (first token at step 0): burst steps 1-2, then 8 decodes. Prompt 2 (step 1): step 2, 8
    # decodes (steps 3-10), 1 steady. Prompt 3 (step 2): 8 decodes, 2 steady.
    decode = [200 + 160, 200 + 160, 100 + 160 + steady, 160 + 2 * steady]
    assert run.mean_ttft_ms == pytest.approx(server + (100 + 100 + 200 + 300) / 4)
    assert run.median_ttft_ms == pytest.approx(server + 100)
    assert run.mean_tpot_ms == pytest.approx(sum(decode) / 4 / 10)
    # The run ends when the last of them does: prompt 3, at 300 ms + its decodes.
    assert run.duration_s == pytest.approx((server + 300 + decode[3]) / 1e3)
    assert run.throughput_tokens_per_s == pytest.approx(4 * 11 / run.duration_s)


def test_the_requests_after_the_burst_see_the_steady_state():
    steps = ConstantSteps()
    one_wave = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 4, steps)
    run = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 12, steps)
    steady = vllm_predict(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, steps)
    assert run.mean_ttft_ms == pytest.approx((4 * one_wave.mean_ttft_ms + 8 * steady.ttft_ms) / 12)
    assert run.median_ttft_ms == pytest.approx(steady.ttft_ms)
    # Each of the 4 slots serves 2 more requests at the steady cycle after the burst's.
    cycle = steady.own_ttft_ms + 10 * steady.tpot_ms
    assert run.duration_s == pytest.approx(one_wave.duration_s + 2 * cycle / 1e3)
    # 1 prompt in 11 steps per slot, one chunk each: 4/11 of the steps carry one, so the median gap is a decode.
    assert run.median_itl_ms == 20.0


def test_prompts_already_in_the_prefix_cache_cost_one_token_each():
    # Prompts 0 and 1 cached: the stream is 1 + 1 + 4096 + 4096 tokens; step 0 reads 8192 of them (prompts 0-2
    # end at 1, 2 and 4098), step 1 the last 2 (three decodes go first).
    wave = burst(ConstantSteps(), 4, 4096, 8192, cached=2)
    assert wave.first_step == [0, 0, 0, 1]
    assert wave.first_token_ms == [100.0, 100.0, 100.0, 200.0]
    steps = ConstantSteps()
    cold = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 12, steps)
    warm = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 12, steps, cached=6)
    steady = vllm_predict(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, steps)
    efficiency = VLLM.efficiency["gpu"]
    server = efficiency.request_overhead_ms + efficiency.tokenize_us_per_token * 4096 * 1e-3
    # The burst (first tokens at 100, 100, 200, 300 cold; 100, 100, 100, 100 with all four cached: 4 tokens), then
    # 2 cached requests at half a step's wait and one steady step, 6 at the steady TTFT.
    assert warm.mean_ttft_ms == pytest.approx((4 * (server + 100) + 2 * (server + 1.5 * steady.tpot_ms)
                                               + 6 * steady.ttft_ms) / 12)
    assert warm.mean_ttft_ms < cold.mean_ttft_ms
