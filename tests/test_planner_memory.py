"""Memory per device: weights, KV cache (exact), GQA replication, capacity."""

from __future__ import annotations

import pytest

from lmc.planner import catalog
from lmc.planner.engines import engine_facts, reference_model
from lmc.planner.memory import (
    PAGED_BLOCK_TOKENS,
    PAGED_FIRST_BLOCKS,
    capacity_bytes,
    kv_reserve_bytes,
    overhead_bytes,
    paged_pool_blocks,
    runtime_overhead_bytes,
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
    efficiency = hf.efficiency["gpu"]
    assert overhead_bytes(efficiency, 2) - overhead_bytes(efficiency, 1) == efficiency.comm_buffer_bytes > 0
    one = memory_per_device(GPTJ, A10G_X4, hf, efficiency, "fp16", 1, 1, 128, 128, 0.9, None)
    two = memory_per_device(GPTJ, A10G_X4, hf, efficiency, "fp16", 2, 1, 128, 128, 0.9, None)
    for tp, mem in ((1, one), (2, two)):  # the rest of the overhead follows each rank's own KV cache
        assert mem.runtime_overhead == runtime_overhead_bytes(GPTJ, A10G_X4, hf, efficiency, tp, "fp16", 1, 128, 128,
                                                              mem.kv_cache)


# --- The GPU loop's measurements (bench/gpu/gpu_loop.py, H200, hf engine, fp16; README "GPU checks"):
# a random Llama of Llama-2-7B's width with the tiny tokenizer's vocabulary, at 8 and 32 layers, served at
# 128 tokens in, 64 out, 32 concurrent. nvidia-smi's peak per process: 6.1 GiB (8 layers), 20.0 GiB (32).

GIB = 2**30
H200 = catalog.accelerator_facts("h200", 1)


def _gpu_loop_model(layers: int):
    from lmc.planner.facts import ModelFacts
    from lmc.testing.checkpoints import VOCAB_SIZE
    from tests._scripts import load_script

    shape = load_script("bench/gpu/gpu_loop.py").LLAMA_7B
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    block = 4 * hidden * hidden + 3 * hidden * inner + 2 * hidden  # q, k, v, o; gate, up, down; two norms
    return ModelFacts(id=f"lmc/random-llama-7b-{layers}-layers", family="llama", architecture="LlamaForCausalLM",
                      parameters=layers * block + 2 * VOCAB_SIZE * hidden + hidden, layers=layers,
                      hidden_size=hidden, attention_heads=shape["num_attention_heads"],
                      kv_heads=shape["num_key_value_heads"], head_dim=hidden // shape["num_attention_heads"],
                      intermediate_size=inner, vocab_size=VOCAB_SIZE, source="bench/gpu/gpu_loop.py")


@pytest.mark.parametrize("layers, peak_gib", [(8, 6.1), (32, 20.0)])
def test_the_gpu_loop_plan_covers_nvidia_smis_peak(layers, peak_gib):
    model, hf = _gpu_loop_model(layers), ENGINES["hf"]
    efficiency = hf.efficiency["gpu"]
    batch, tokens_in, tokens_out = 32, 128, 64
    mem = memory_per_device(model, H200, hf, efficiency, "fp16", 1, batch, tokens_in, tokens_out, 0.9, None)
    # weights: every parameter in fp16, nothing split
    assert mem.weights == model.parameters * 2
    # the live KV cache: 32 rows of 192 positions, K and V of 32 heads × 128 per layer in fp16
    per_token = 2 * layers * 32 * 128 * 2
    assert mem.kv_cache == batch * (tokens_in + tokens_out) * per_token
    # the PagedCache needs 32 × ceil(192 / 16) = 384 blocks: its pool of 64 doubles to 512, and the allocator
    # keeps the freed pools of 64, 128 and 256 blocks: 960 blocks of 16 positions reserved
    assert paged_pool_blocks(384) == 512
    reserve = kv_reserve_bytes(model, 1, "fp16", batch, tokens_in, tokens_out, mem.kv_cache)
    assert reserve == (64 + 128 + 256 + 512) * 16 * per_token
    # runtime: the CUDA context (the catalog's 1 GiB), the pools beyond the live cache, one layer's gathered K/V
    assert efficiency.runtime_overhead_bytes == GIB
    assert mem.runtime_overhead == GIB + (reserve - mem.kv_cache) + mem.kv_cache // layers
    assert mem.total == mem.weights + mem.kv_cache + mem.activations + mem.runtime_overhead
    assert mem.total >= peak_gib * GIB, mem.total / GIB


def test_the_paged_pool_constants_are_the_runtimes():
    paged = pytest.importorskip("lmc.runtime.engines.paged")
    assert (PAGED_FIRST_BLOCKS, PAGED_BLOCK_TOKENS) == (paged._FIRST_BLOCKS, paged.BLOCK_SIZE)
    from lmc.planner.scheduling import BLOCK_SIZE

    assert BLOCK_SIZE == PAGED_BLOCK_TOKENS  # the plan's kv_cache.block_size, which the runtime is given


def test_a_growing_dynamic_cache_reserves_a_second_cache_when_the_pool_would_reserve_less():
    model = _gpu_loop_model(8)
    # one row of 1024 positions: 64 blocks, the pool's first size (never grown): 64 blocks reserved, while
    # DynamicCache's torch.cat growth leaves the previous step's tensors cached: twice the live cache
    kv = 1024 * kv_bytes_per_token(model, 1, "fp16")
    assert paged_pool_blocks(64) == 64
    assert kv_reserve_bytes(model, 1, "fp16", 1, 1000, 24, kv) == 2 * kv


@pytest.mark.parametrize("engine, hardware", [
    ("hf", catalog.local_facts()),  # a CPU host: freed blocks go back to the system, no caching allocator
    ("vllm", H200),  # vLLM's own pool, sized inside gpu_memory_utilization (lmc.planner.vllm)
    ("neuronx", catalog.hardware_facts("ml.inf2.8xlarge")),
])
def test_only_lmcs_decode_loop_on_a_gpu_pays_the_allocators_reserve(engine, hardware):
    facts = ENGINES[engine]
    efficiency = facts.efficiency[hardware.kind]
    assert runtime_overhead_bytes(_gpu_loop_model(8), hardware, facts, efficiency, 1, "fp16", 32, 128, 64,
                                  10 * GIB) == overhead_bytes(efficiency, 1)
