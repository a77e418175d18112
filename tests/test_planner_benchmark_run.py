"""A finite benchmark run (lmc/planner/benchmark_run.py): the first `concurrency` prompts arrive together, vLLM's
scheduler serves decodes first and then prompt chunks in arrival order within the token budget; figures checked
against hand-derived ones with step times that are constants."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from lmc.planner import catalog
from lmc.planner.benchmark_run import burst, list_schedule_ms, vllm_benchmark_run
from lmc.planner.engines import engine_facts
from lmc.planner.steps import chunked_prompt_attention_ms, own_server_ms
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

    def server_ms(self, efficiency, prompt: int) -> float:
        return own_server_ms(efficiency, prompt)


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


@dataclass(frozen=True)
class FlatSteps(ConstantSteps):
    """Every step costs 20 ms, whatever it reads: the steady step is a plain decode, so the drain runs at it."""

    def prefill_ms(self, tokens: int) -> float:
        return 20.0

    def mixed_ms(self, chunk: int, batch: int, prompt: int, context: int) -> float:
        return 20.0


def test_the_requests_after_the_burst_see_the_steady_state():
    steps = ConstantSteps()
    one_wave = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 4, steps)
    run = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 12, steps)
    steady = vllm_predict(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, steps)
    assert run.mean_ttft_ms == pytest.approx((4 * one_wave.mean_ttft_ms + 8 * steady.ttft_ms) / 12)
    assert run.median_ttft_ms == pytest.approx(steady.ttft_ms)
    # Each of the 4 slots serves 2 more requests at the steady cycle after the burst's; the last wave drains at
    # plain decode steps (20 ms) instead of the steady 49 ms that carried the joining prompts: shorter.
    cycle = steady.own_ttft_ms + 10 * steady.tpot_ms
    assert one_wave.duration_s + cycle / 1e3 < run.duration_s < one_wave.duration_s + 2 * cycle / 1e3
    # Where a step costs the same with or without prompts, the drain is the steady state: exactly 2 cycles more.
    flat = FlatSteps()
    flat_wave = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 4, flat)
    flat_run = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 12, flat)
    flat_steady = vllm_predict(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, flat)
    assert flat_steady.tpot_ms == pytest.approx(20.0)
    assert flat_run.duration_s == pytest.approx(flat_wave.duration_s + 2 * (flat_steady.own_ttft_ms + 200) / 1e3)
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


def test_a_list_schedule_of_spread_lengths_lies_within_grahams_bounds():
    # 3 slots whose first requests start decoding at 0, 5 and 10 ms (1 ms steps), then 9 more requests, each 2 ms
    # of TTFT and (length − 1) steps, lengths spread over 1..100 with mean 40; drained at the same 1 ms step, the
    # run ends at the list schedule's makespan: no earlier than the work spread evenly over the 3 slots, no later
    # than that plus the longest request (the client gives each request the first slot that frees).
    burst = [(0.0, 1.0), (5.0, 1.0), (10.0, 1.0)]
    for seed in range(8):
        end = list_schedule_ms(burst, 12, (1, 100), 40.0, 2.0, 1.0, lambda batch: 1.0, seed)
        low, high = 1, 100
        lengths = [low + (high - low) * (i + 0.5) / 12 for i in range(12)]
        lengths = [length * 40.0 / (sum(lengths) / 12) for length in lengths]
        work = sum(length - 1 for length in lengths) + 9 * 2.0 + 5.0 + 10.0
        assert work / 3 <= end <= work / 3 + max(lengths) + 2.0


def test_output_lengths_drawn_from_a_range_end_the_run_later_than_fixed_ones_of_the_same_mean():
    # 4 clients, 12 requests: with fixed lengths the 4 slots finish together; with lengths spread over 1..21
    # (mean 11) the run waits for the slot that drew the longest answers. At one client the order does not
    # matter: the same tokens in the same steps (within the drain's conversion of the last TTFT).
    steps = ConstantSteps()
    fixed = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 12, steps)
    spread = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 4, 12, steps,
                                output_range=(1, 21))
    assert spread.duration_s > fixed.duration_s * 1.05
    assert spread.mean_tpot_ms == fixed.mean_tpot_ms and spread.mean_ttft_ms == fixed.mean_ttft_ms
    alone = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 1, 10, steps)
    alone_spread = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 1, 10, steps,
                                      output_range=(1, 21))
    assert alone_spread.duration_s == pytest.approx(alone.duration_s, rel=0.1)


@dataclass(frozen=True)
class QuadraticSteps:
    """A prefill whose attention grows with the square of the prompt (5 ms + 0.02 ms a token + 1 µs · tokens²),
    and a mixed step as the decode plus the chunk's prefill beyond a one-token pass (steps.chunk_beside_decodes_ms)."""

    source: str = "quadratic"

    def prefill_ms(self, tokens: int) -> float:
        return 5.0 + 0.02 * tokens + 1e-6 * tokens ** 2

    def decode_ms(self, batch: int, context: int) -> float:
        return 20.0

    def mixed_ms(self, chunk: int, batch: int, prompt: int, context: int) -> float:
        return self.decode_ms(batch, context) + self.prefill_ms(chunk) - self.prefill_ms(1)

    def server_ms(self, efficiency, prompt: int) -> float:
        return own_server_ms(efficiency, prompt)


def test_a_prompt_read_in_chunks_costs_its_whole_prefill_its_later_chunks_attending_to_the_earlier():
    steps = QuadraticSteps()
    # One 20000-token prompt, budget 8192: three steps of 8192, 8192 and 3616 tokens. Each later chunk also reads
    # the chunks before it, so the three cost the whole prompt's prefill, plus a one-token pass per extra step.
    wave = burst(steps, 1, 20000, 8192)
    assert len(wave.step_ms) == 3
    assert wave.first_token_ms[0] == pytest.approx(steps.prefill_ms(20000) + 2 * steps.prefill_ms(1))
    assert wave.step_ms[2] > steps.prefill_ms(3616) + 15.0  # the last chunk's attention over 16384 earlier tokens
    assert chunked_prompt_attention_ms(steps, 20000, 8192) == pytest.approx(
        steps.prefill_ms(20000) - 2 * steps.prefill_ms(8192) - steps.prefill_ms(3616) + 2 * steps.prefill_ms(1))
    assert chunked_prompt_attention_ms(steps, 8192, 8192) == 0.0  # one step: nothing earlier to read


def test_in_the_steady_state_a_chunked_prompt_adds_its_whole_prefill_to_the_steps_it_joins():
    steps = QuadraticSteps()
    running = 4
    layout = replace(LAYOUT, max_num_batched_tokens=8192 + running)  # a budget of 8192 prompt tokens a step
    timing = vllm_predict(QWEN8, H100, VLLM, "bf16", 1, 1, layout, 16384, 100, running, steps)
    joins = running / 100  # prompts per step
    # a prompt of two 8192-token chunks adds what its whole prefill costs beyond a one-token pass
    assert (timing.tpot_ms - 20.0) / joins == pytest.approx(steps.prefill_ms(16384) - steps.prefill_ms(1))
    assert (timing.tpot_ms - 20.0) / joins > 2 * (steps.prefill_ms(8192) - steps.prefill_ms(1)) + 60.0


def test_fewer_clients_than_data_parallel_groups_leave_groups_empty():
    """4 clients, 8 prompts on 8 DP groups: 4 groups run one request at a time, twice; the run lasts two
    requests, not one (each of 8 groups was given one prompt of the 8, so the run's throughput was twice)."""
    steps = FlatSteps()
    dp8 = replace(LAYOUT, data_parallel_size=8)
    one = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, LAYOUT, 4096, 11, 1, 1, steps)
    run = vllm_benchmark_run(QWEN8, H100, VLLM, "bf16", 1, 1, dp8, 4096, 11, 4, 8, steps)
    # the same flat steps: each busy group serves its two requests one after the other
    assert run.duration_s == pytest.approx(2 * one.duration_s, rel=0.05)
    assert run.throughput_tokens_per_s == pytest.approx(8 * 11 / run.duration_s)
