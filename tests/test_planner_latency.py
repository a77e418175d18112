"""Latency model: the all-reduce arithmetic, physics checks, and the published measurements held to
the bounds docs/planner.md reports."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from lmc.planner import catalog
from lmc.planner.engines import engine_facts, measurements, reference_model
from lmc.planner.facts import InterconnectFacts
from lmc.planner.latency import allreduce_ms, allreduce_us, predict, send_us, tpot_ms, ttft_ms
from lmc.planner.validation import checks, markdown_table, summarize

ENGINES = engine_facts()
# The latency model's fused-kernel figures, as the published rows measure them: lmc's runtime injects no
# kernels today (engines.toml, `kernel_injection`), so the shipped deepspeed facts plan unfused.
FUSED_DEEPSPEED = ENGINES["deepspeed"].model_copy(update={"kernel_injection": True})
P4DE = catalog.hardware_facts("ml.p4de.24xlarge")
G5 = catalog.hardware_facts("ml.g5.12xlarge")
LLAMA7 = reference_model("llama-2-7b")
LLAMA70 = reference_model("llama-2-70b")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "planner.md"
# The issue's bounds on the table of published measurements (docs/planner.md, "Validation").
DECODE_MEDIAN, DECODE_WORST, TTFT_MEDIAN = 0.10, 0.35, 0.20
# No issue bound on the worst first token: Neuron's bucketed context encoding has outliers (-65%);
# this keeps a prediction from drifting further unseen.
TTFT_WORST = 0.70


# --- all-reduce arithmetic -----------------------------------------------------------------------

def _link(algorithm: str = "ring") -> InterconnectFacts:
    return InterconnectFacts(name="test", bandwidth_bytes_per_s=100e9, latency_us=2.0, allreduce_base_us=5.0,
                             algorithm=algorithm)


@pytest.mark.parametrize("ranks", [2, 4, 8, 24])
def test_ring_allreduce_pays_2_p_minus_1_steps_and_2_p_minus_1_over_p_of_the_message(ranks):
    link = _link()
    small = allreduce_us(link, ranks, 0)
    assert small == pytest.approx(5.0 + 2 * (ranks - 1) * 2.0)
    big = allreduce_us(link, ranks, 1e9)
    assert big - small == pytest.approx(2 * (ranks - 1) / ranks * 1e9 / 100e9 * 1e6)


@pytest.mark.parametrize("ranks, levels", [(2, 1), (4, 2), (8, 3), (16, 4), (24, 5)])
def test_tree_allreduce_pays_two_steps_per_level_and_twice_the_message(ranks, levels):
    link = _link("tree")
    assert allreduce_us(link, ranks, 0) == pytest.approx(5.0 + 2 * levels * 2.0)
    assert allreduce_us(link, ranks, 1e9) - allreduce_us(link, ranks, 0) == pytest.approx(2 * 1e9 / 100e9 * 1e6)


def test_one_rank_reduces_nothing():
    assert allreduce_us(_link(), 1, 1e9) == 0
    assert allreduce_us(_link("tree"), 1, 1e9) == 0
    assert allreduce_ms(P4DE, FUSED_DEEPSPEED.efficiency["gpu"], 1, 1e9) == 0


def test_ring_latency_grows_with_the_rank_count_and_the_tree_overtakes_it():
    ring, tree = _link(), _link("tree")
    times = [allreduce_us(ring, p, 1024) for p in (2, 4, 8)]
    assert times[0] < times[1] < times[2]
    assert allreduce_us(tree, 64, 1024) < allreduce_us(ring, 64, 1024)


def test_engine_allreduce_adds_its_overhead_and_reaches_its_share_of_bandwidth():
    efficiency = FUSED_DEEPSPEED.efficiency["gpu"]
    link = P4DE.interconnect
    expected = (link.allreduce_base_us + 14 * link.latency_us + 2 * 7 / 8 * 1e8 / (link.bandwidth_bytes_per_s
                * efficiency.allreduce_efficiency) * 1e6 + efficiency.allreduce_overhead_us) / 1e3
    assert allreduce_ms(P4DE, efficiency, 8, 1e8) == pytest.approx(expected)


def test_send_pays_one_step():
    link = _link()
    assert send_us(link, 1e9) == pytest.approx(5.0 + 2.0 + 1e9 / 100e9 * 1e6)


def test_multi_gpu_instances_know_their_network():
    for name, gbps in (("ml.p4d.24xlarge", 400), ("ml.p5.48xlarge", 3200), ("ml.trn1.32xlarge", 800)):
        network = catalog.hardware_facts(name).network
        assert network is not None and network.name.startswith("EFA")
        assert network.bandwidth_bytes_per_s == gbps * 1e9 / 8 and network.algorithm == "tree"
    assert catalog.hardware_facts("ml.g5.xlarge").network is None


# --- published measurements ----------------------------------------------------------------------

def test_decode_error_on_the_published_table_is_within_the_issue_bounds():
    decode = summarize(checks(), "tpot")
    assert decode.median_abs_error <= DECODE_MEDIAN, decode
    assert decode.worst_abs_error <= DECODE_WORST, decode


def test_the_decode_table_spans_tensor_parallel_degrees_1_to_8_on_several_engines_and_hardware():
    decode = [c.measurement for c in checks() if c.metric == "tpot"]
    assert {1, 2, 4, 8} <= {m.tensor_parallel_degree for m in decode}
    assert len({m.system for m in decode}) >= 4 and len({m.hardware.accelerator for m in decode}) >= 3
    for tp in (1, 2, 4, 8):  # each degree has held-out rows, not only calibration ones
        assert any(m.tensor_parallel_degree == tp and m.role == "validation" for m in decode), tp


def test_time_to_first_token_error_on_the_published_table_is_within_the_issue_bound():
    ttft = summarize(checks(), "ttft")
    assert ttft.count >= 10
    assert ttft.median_abs_error <= TTFT_MEDIAN, ttft
    assert ttft.worst_abs_error <= TTFT_WORST, ttft


@pytest.mark.parametrize("check", [c for c in checks() if c.metric == "tpot"],
                         ids=lambda c: c.measurement.name)
def test_every_published_decode_measurement_within_the_worst_bound(check):
    assert abs(check.error) <= DECODE_WORST, (check.measurement.name, check.predicted_ms, check.measured_ms)


def test_most_rows_are_held_out():
    rows = checks()
    assert sum(c.measurement.role == "validation" for c in rows) > sum(c.measurement.role == "calibration" for c in rows)


def test_docs_carry_the_current_validation_table():
    """docs/planner.md prints `python -m lmc.planner.validation`; a changed figure must update it."""
    assert markdown_table() in DOCS.read_text(encoding="utf-8")


def test_high_tp_decode_is_slower_than_bandwidth_alone_predicts():
    """What the issue measured: at TP 8 the all-reduces and per-layer costs are a large share of a step."""
    deepspeed = FUSED_DEEPSPEED
    efficiency = deepspeed.efficiency["gpu"]
    one = tpot_ms(LLAMA7, P4DE, deepspeed, "bf16", 1, 1, 128, 128)
    eight = tpot_ms(LLAMA7, P4DE, deepspeed, "bf16", 8, 1, 128, 128)
    assert eight > one / 8 * 1.5
    comm = 2 * LLAMA7.layers * allreduce_ms(P4DE, efficiency, 8, LLAMA7.hidden_size * 2)
    assert comm > 0.2 * eight


def test_prefill_is_compute_bound_at_long_prompts():
    deepspeed = FUSED_DEEPSPEED
    short, long = (ttft_ms(LLAMA7, P4DE, deepspeed, "fp16", 1, n) for n in (128, 4096))
    assert long > 10 * short  # 32x the tokens: compute, not the weight read, sets the time
    flops = 2 * 6.74e9 * 4096
    assert long > flops / (312e12 * deepspeed.efficiency["gpu"].prefill_compute) * 1e3


def test_tpot_falls_with_tp_but_not_linearly():
    deepspeed = FUSED_DEEPSPEED
    times = [tpot_ms(LLAMA70, P4DE, deepspeed, "bf16", tp, 1, 512, 128) for tp in (2, 4, 8)]
    assert times[0] > times[1] > times[2]
    assert times[2] > times[0] / 4  # 4× the devices gives less than 4× the speed


def test_int8_faster_than_fp16_when_bandwidth_bound():
    deepspeed = FUSED_DEEPSPEED
    fp16 = tpot_ms(LLAMA7, G5, deepspeed, "fp16", 1, 1, 128, 128)
    int8 = tpot_ms(LLAMA7, G5, deepspeed, "int8", 1, 1, 128, 128)
    assert int8 < fp16 * 0.75


def test_batch_raises_throughput_and_tpot():
    deepspeed = FUSED_DEEPSPEED
    one = predict(LLAMA7, G5, deepspeed, "fp16", 4, 1, 1, 512, 128)
    eight = predict(LLAMA7, G5, deepspeed, "fp16", 4, 1, 8, 512, 128)
    assert eight.throughput_tokens_per_s > 4 * one.throughput_tokens_per_s
    assert eight.tpot_ms > one.tpot_ms


def test_fused_kernels_beat_autotp_and_hf():
    ds_llama = tpot_ms(LLAMA7, G5, FUSED_DEEPSPEED, "fp16", 1, 1, 128, 128)
    hf_llama = tpot_ms(LLAMA7, G5, ENGINES["hf"], "fp16", 1, 1, 128, 128)
    assert ds_llama < hf_llama / 2
    # Without injection (what lmc's runtime does today) DeepSpeed runs the HF modules: hf's speed, no better.
    assert tpot_ms(LLAMA7, G5, ENGINES["deepspeed"], "fp16", 1, 1, 128, 128) == pytest.approx(hf_llama, rel=0.05)


def test_cost_per_million_tokens_follows_price_and_throughput():
    t = predict(LLAMA7, G5, FUSED_DEEPSPEED, "fp16", 2, 2, 4, 512, 128)
    assert t.instances_used == 1
    assert t.cost_per_hour == G5.price_per_hour
    assert t.cost_per_million_tokens == pytest.approx(G5.price_per_hour / (t.throughput_tokens_per_s * 3600) * 1e6)
    assert t.throughput_tokens_per_s == pytest.approx(2 * 4 / t.tpot_ms * 1000)


def test_neuron_compile_at_start_only_for_families_without_serialization():
    inf2 = catalog.hardware_facts("ml.inf2.8xlarge")
    neuronx = ENGINES["neuronx"]
    gptj = predict(reference_model("gpt-j-6b"), inf2, neuronx, "bf16", 2, 1, 1, 128, 128)
    llama = predict(LLAMA7, inf2, neuronx, "bf16", 2, 1, 1, 128, 128)
    assert gptj.load_seconds > llama.load_seconds + 300  # ~6 minutes of compile for 6B parameters


def test_tp_ranks_on_one_cpu_host_share_its_bandwidth_and_compute():
    """CPU TP ranks are processes on the same cores and memory: splitting a model across them must not
    predict a speed-up (it used to: TP 8 on the 2-core profile came out 6x faster than TP 1)."""
    from pathlib import Path

    cpu = catalog.profile_facts(Path(__file__).resolve().parent.parent / "specs/profiles/cpu-2core.toml")
    model, engine = reference_model("llama-2-7b"), ENGINES["hf"]
    one, eight = (predict(model, cpu, engine, "bf16", tp, 1, 1, 128, 128).tpot_ms for tp in (1, 8))
    assert eight >= one


def test_a_profile_with_zero_or_infinite_figures_is_refused(tmp_path):
    from lmc.errors import SpecValueError

    for line in ('tflops = { fp32 = 0.0 }', 'price_per_hour = inf'):
        profile = tmp_path / "p.toml"
        profile.write_text(f'base = "local"\n{line}\n')
        with pytest.raises(SpecValueError) as excinfo:
            catalog.profile_facts(profile)
        assert excinfo.value.key_path == "target.profile"


def test_data_parallel_attention_reads_a_share_of_the_experts_and_pays_the_gathers():
    """DeepSeek-V3 on eight H200s: with data-parallel attention over 8 groups (TP 1 each) a rank holds and
    reads 1/8 of the routed experts (those the 8 groups' tokens touch), every MoE block all-gathers all
    groups' tokens and reduce-scatters the results (vLLM's default all2all backend), and a replica's
    throughput counts all its groups."""
    from lmc.planner.latency import _dp_comm_ms, allgather_ms, allreduce_ms, dp_weight_bytes, moe_layer_count, predict

    deepseek = catalog.model_facts("deepseek-ai/DeepSeek-V3")
    p5en = catalog.hardware_facts("ml.p5en.48xlarge")
    vllm = ENGINES["vllm"]
    efficiency = vllm.efficiency["gpu"]
    assert moe_layer_count(deepseek) == 58  # 61 blocks, the first three dense
    assert allgather_ms(p5en, efficiency, 1, 1e6) == 0 and allgather_ms(p5en, efficiency, 8, 2e6) > allgather_ms(
        p5en, efficiency, 8, 1e6) > 0
    # All experts touched (a large step): the experts' share of the bytes falls by the DP degree.
    whole = dp_weight_bytes(1.0, deepseek, 1)
    spread = dp_weight_bytes(1.0, deepseek, 8)
    assert whole == pytest.approx(1.0) and 0.1 < spread < 0.2  # the experts are ~95 % of DeepSeek's matrices
    # TP 1: no all-reduce; per MoE block one all-gather and one reduce-scatter of the 8 groups' 16 tokens each.
    width = deepseek.hidden_size * 2
    assert _dp_comm_ms(deepseek, p5en, efficiency, 1, 8, 16, "bf16") == pytest.approx(
        2 * 58 * allgather_ms(p5en, efficiency, 8, 8 * 16 * width))
    # TP 2 × DP 4: attention's (and the 3 dense blocks') all-reduces within the pair, the gathers over all 8
    # ranks, and the pair's re-gather of its own tokens after each MoE block (sequence-parallel MoE).
    assert _dp_comm_ms(deepseek, p5en, efficiency, 2, 4, 16, "bf16") == pytest.approx(
        (61 + 3) * allreduce_ms(p5en, efficiency, 2, 16 * width)
        + 58 * (2 * allgather_ms(p5en, efficiency, 8, 4 * 16 * width) + allgather_ms(p5en, efficiency, 2, 16 * width)))
    # A prompt's step gathers the prompt's tokens, not DP copies of it.
    assert _dp_comm_ms(deepseek, p5en, efficiency, 1, 8, 1024, "bf16", gathered=1024) < _dp_comm_ms(
        deepseek, p5en, efficiency, 1, 8, 1024, "bf16")
    one = predict(deepseek, p5en, vllm, "fp8", 1, 1, 16, 1024, 256, dp=8)
    assert one.throughput_tokens_per_s == pytest.approx(8 * 16 / one.tpot_ms * 1e3)
    assert one.instances_used == 1


def test_vllms_custom_allreduce_on_nvlink_takes_one_or_two_stages_instead_of_ncclss_ring():
    from lmc.planner.latency import allreduce_ms, custom_allreduce_us

    vllm = engine_facts()["vllm"].efficiency["gpu"]
    p5, g5 = catalog.hardware_facts("ml.p5.48xlarge"), catalog.hardware_facts("ml.g5.12xlarge")
    link = p5.interconnect  # 450 GB/s per rank, 0.6 µs a step; vLLM reaches 0.7 of it, 3 µs a stage
    # 4 ranks, 256 KiB (below 512 KiB): one stage, every peer's whole message read.
    assert custom_allreduce_us(link, vllm, 4, 262144) == pytest.approx(3.6 + 3 * 262144 / (450e9 * 0.7) * 1e6)
    # 8 ranks, 512 KiB (not below 256 KiB): reduce-scatter then all-gather, 7/8 of it each.
    assert custom_allreduce_us(link, vllm, 8, 524288) == pytest.approx(2 * 3.6 + 2 * 7 / 8 * 524288 / 315e9 * 1e6)
    # NCCL's ring beyond: past 8 MiB, at 3 ranks, on PCIe past 2 ranks, for engines without such kernels.
    assert custom_allreduce_us(link, vllm, 8, 9 * 2**20) is None
    assert custom_allreduce_us(link, vllm, 3, 262144) is None
    assert custom_allreduce_us(g5.interconnect, vllm, 4, 262144) is None
    assert custom_allreduce_us(g5.interconnect, vllm, 2, 262144) is not None
    deepspeed = engine_facts()["deepspeed"].efficiency["gpu"]
    assert custom_allreduce_us(link, deepspeed, 4, 262144) is None
    assert allreduce_ms(p5, vllm, 8, 327680) < allreduce_ms(p5, deepspeed.model_copy(
        update={"allreduce_overhead_us": 0.0, "allreduce_efficiency": 0.7}), 8, 327680)
