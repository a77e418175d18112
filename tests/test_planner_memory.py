"""Memory per device: weights, KV cache (exact), GQA replication, capacity."""

from __future__ import annotations

import pytest

from lmc.planner import catalog
from lmc.planner.engines import engine_facts, reference_model
from lmc.planner.memory import (
    capacity_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    memory_per_device,
    weight_bytes,
)

ENGINES = engine_facts()
A10G_X4 = catalog.hardware_facts("ml.g5.12xlarge")
P4DE = catalog.hardware_facts("ml.p4de.24xlarge")
GPTJ = reference_model("gpt-j-6b")
BLOOM = reference_model("bloom-176b")
LLAMA70 = reference_model("llama-2-70b")


def test_gptj_fp16_weights_at_tp1_within_3_percent_of_12_1_gb():
    weights = weight_bytes(GPTJ, ENGINES["deepspeed"], "fp16", 1, A10G_X4)
    assert abs(weights - 12.1e9) / 12.1e9 < 0.03, weights


def test_gptj_tp2_halves_matrices_but_replicates_the_embedding():
    one = weight_bytes(GPTJ, ENGINES["deepspeed"], "fp16", 1, A10G_X4)
    two = weight_bytes(GPTJ, ENGINES["deepspeed"], "fp16", 2, A10G_X4)
    embedding = GPTJ.vocab_size * GPTJ.hidden_size * 2
    assert one / 2 < two < one / 2 + embedding  # more than half: the embedding is on every rank


def test_bloom_bf16_total_about_352_gb():
    per_device = weight_bytes(BLOOM, ENGINES["deepspeed"], "bf16", 8, P4DE)
    embedding = BLOOM.vocab_size * BLOOM.hidden_size * 2
    total = (per_device - embedding) * 8 + embedding  # the tied embedding once
    assert total == pytest.approx(352e9, rel=0.01)


def test_int8_weight_only_keeps_embedding_16_bit_and_adds_scales():
    fp16 = weight_bytes(GPTJ, ENGINES["deepspeed"], "fp16", 1, A10G_X4)
    int8 = weight_bytes(GPTJ, ENGINES["deepspeed"], "int8", 1, A10G_X4)
    embedding_and_head = 2 * GPTJ.vocab_size * GPTJ.hidden_size * 2
    matrices_fp16 = fp16 - embedding_and_head
    assert int8 > embedding_and_head + matrices_fp16 / 2  # scales on top of 1 byte per weight
    assert int8 < embedding_and_head + matrices_fp16 / 2 * 1.01


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_bytes_per_token_is_exact(tp):
    model = reference_model("llama-2-13b")  # 40 kv heads: divisible by 1, 2, 4, 8
    expected = 2 * model.layers * model.kv_heads * model.head_dim * 2 // tp
    assert kv_bytes_per_token(model, tp, "fp16") == expected


def test_kv_gqa_split_by_tp_then_replicated_beyond_kv_heads():
    # Llama-2-70B: 8 kv heads. TP 2/4/8 split them; TP 16 holds one (replicated) head per rank.
    full = 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_token(LLAMA70, 2, "bf16") == full // 2
    assert kv_bytes_per_token(LLAMA70, 8, "bf16") == full // 8
    assert kv_bytes_per_token(LLAMA70, 16, "bf16") == full // 8  # ceil(8/16) = 1 head, not half a head


def test_t5_cache_includes_cross_attention_and_encoder_output():
    t5 = catalog.model_facts("google/flan-t5-xxl")
    decoder_only = 2 * (256) * kv_bytes_per_token(t5, 4, "bf16")
    cache = kv_cache_bytes(t5, 4, "bf16", 2, 512, 256)
    assert cache == 2 * (256 + 512) * kv_bytes_per_token(t5, 4, "bf16") + 2 * 512 * t5.hidden_size * 2
    assert cache > decoder_only


def test_breakdown_adds_up_and_capacity_is_the_smaller_of_fraction_and_cap():
    deepspeed = ENGINES["deepspeed"]
    mem = memory_per_device(GPTJ, A10G_X4, deepspeed, deepspeed.efficiency["gpu"], "fp16", 2, 4, 1024, 256,
                            0.9, 20 * 2**30)
    assert mem.total == mem.weights + mem.kv_cache + mem.activations + mem.runtime_overhead
    assert mem.capacity == 20 * 2**30  # the cap is below 0.9 × 24 GiB
    assert mem.headroom == mem.capacity - mem.total
    assert mem.kv_cache == 4 * 1280 * kv_bytes_per_token(GPTJ, 2, "fp16")
    assert capacity_bytes(A10G_X4, 0.9, None) == int(24 * 2**30 * 0.9)
    assert all(isinstance(v, int) for v in mem.model_dump().values())


def test_comm_buffers_only_when_tensor_parallel():
    hf = ENGINES["hf"]
    one = memory_per_device(GPTJ, A10G_X4, hf, hf.efficiency["gpu"], "fp16", 1, 1, 128, 128, 0.9, None)
    two = memory_per_device(GPTJ, A10G_X4, hf, hf.efficiency["gpu"], "fp16", 2, 1, 128, 128, 0.9, None)
    assert two.runtime_overhead - one.runtime_overhead == hf.efficiency["gpu"].comm_buffer_bytes > 0
