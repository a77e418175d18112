"""Facts from any config: parameter counts against what transformers builds from the same config,
KV bytes per token against vLLM's own KV cache specs, quantization_config as lmc reads it."""

from __future__ import annotations

import json

import pytest

from lmc.errors import CheckpointError
from lmc.planner import architecture, catalog
from lmc.planner.memory import kv_bytes_per_token, kv_sequence_bytes

_SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=1000, head_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_NO_HEAD_DIM = {key: value for key, value in _SMALL.items() if key != "head_dim"}

# One small config per layout the rules must read: GQA with q/k norms, MoE, sliding windows mixed
# with full layers, fused projections, MLA with shared experts and dense first layers, attention
# sinks and biases, post-norms, a multimodal wrapper.
CONFIGS = {
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], **_SMALL),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=128, **_SMALL),
    "qwen3_moe_sparse_step": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=2,
                                  mlp_only_layers=[1], **_SMALL),
    "gemma3_text": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=16, **_SMALL),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], **_NO_HEAD_DIM),
    "granite": dict(model_type="granite", architectures=["GraniteForCausalLM"], **_SMALL),
    "olmo2": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], **_NO_HEAD_DIM),
    "gpt_oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=16, **_SMALL),
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=256,
                        intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=1000, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96,
                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=2, topk_group=1),
    # GLM-4.5/4.6/4.7's layout: q/k/v biases without an o_proj bias, per-head q/k norms switched by
    # use_qk_norm, one shared expert, dense first blocks, partial rotary embeddings.
    "glm4_moe": dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], n_routed_experts=8,
                     n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                     attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, n_group=1, topk_group=1,
                     **_SMALL),
    "gemma3": dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                   text_config=dict(model_type="gemma3_text", **_SMALL),
                   vision_config=dict(model_type="siglip_vision_model", hidden_size=128, num_hidden_layers=2,
                                      intermediate_size=256, num_attention_heads=4, image_size=112, patch_size=14)),
}


def transformers_parameters(config: dict) -> int:
    """What transformers builds from `config` (on the meta device: no memory, no weights)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    built = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if not k.startswith("_")})
    built.quantization_config = None  # counted as the logical (unquantized) parameters
    auto = (transformers.AutoModelForImageTextToText if "vision_config" in config
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(built)
    return sum(parameter.numel() for parameter in model.parameters())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameters_equal_what_transformers_builds(name):
    facts = architecture.facts_from_config(CONFIGS[name], "x", source="test")
    assert facts.parameters == transformers_parameters(CONFIGS[name])
    assert facts.family == CONFIGS[name]["model_type"]


def test_moe_active_parameters_and_layout():
    facts = architecture.facts_from_config(CONFIGS["deepseek_v3"], "x", source="test")
    # 3 MoE blocks of 8 routed experts (3 · 256 · 64 each) after one dense block; 2 routed + 1 shared per token.
    experts = 3 * 8 * 3 * 256 * 64
    assert (facts.num_experts, facts.experts_per_token, facts.shared_experts, facts.moe_layers) == (8, 2, 1, 3)
    assert facts.expert_parameters == experts
    assert facts.active_parameters == facts.parameters - experts + experts * 2 // 8
    sparse = architecture.facts_from_config(CONFIGS["qwen3_moe_sparse_step"], "x", source="test")
    assert sparse.moe_layers == 1  # blocks 1 and 3 have (i + 1) % 2 == 0; block 1 is in mlp_only_layers: 3 only


def test_moe_blocks_are_counted_not_enumerated_and_bad_layouts_are_one_line():
    """A corrupt layer count (2**40) ran DeepSeek's and Qwen-MoE's block rules as lists of that many indices until
    the kernel killed the plan; a period of 0, a non-list mlp_only_layers or an odd num_nextn_predict_layers
    crashed it (ZeroDivisionError, TypeError, int('x')). Found by fuzzing the tiny checkpoints' config.json."""
    huge = architecture.facts_from_config(dict(CONFIGS["deepseek_v3"], num_hidden_layers=2**40, moe_layer_freq=3),
                                          "x", source="test")
    assert huge.moe_layers == -(-(2**40 - 1) // 3)  # blocks 1, 4, 7, ... below 2**40
    sparse = architecture.facts_from_config(dict(CONFIGS["qwen3_moe_sparse_step"], num_hidden_layers=2**40,
                                                 mlp_only_layers=[1, 1, 2, 2**41]), "x", source="test")
    assert sparse.moe_layers == 2**40 // 2 - 1  # odd blocks; block 1 kept dense (once), 2 is even, 2**41 is past
    for change, message in [(dict(moe_layer_freq=0), "`moe_layer_freq` must be at least 1, got 0"),
                            (dict(mlp_only_layers=5), "`mlp_only_layers` must list block indices, got 5"),
                            (dict(num_nextn_predict_layers="x"), "`num_nextn_predict_layers` must be an integer"),
                            (dict(num_nextn_predict_layers=-1), "`num_nextn_predict_layers` must not be negative")]:
        with pytest.raises(CheckpointError) as caught:
            architecture.facts_from_config(dict(CONFIGS["deepseek_v3"], **change), "x", source="test",
                                           config_file="c.json")
        assert str(caught.value).startswith("c.json: ") and message in str(caught.value), change


def test_attention_kinds_and_windows():
    kinds = {name: architecture.facts_from_config(config, "x", source="test") for name, config in CONFIGS.items()}
    assert kinds["deepseek_v3"].attention == "mla"
    assert kinds["qwen3"].attention == "gqa"
    gemma = kinds["gemma3_text"]
    # transformers' layer_types, as the config class derives them, say which blocks slide
    assert (gemma.sliding_window, gemma.sliding_window_layers) == (16, sum(
        1 for kind in gemma_layer_types(CONFIGS["gemma3_text"]) if kind == "sliding_attention"))
    oss = kinds["gpt_oss"]
    assert (oss.sliding_window, oss.sliding_window_layers) == (16, sum(
        1 for kind in gemma_layer_types(CONFIGS["gpt_oss"]) if kind == "sliding_attention"))


def gemma_layer_types(config: dict) -> list[str]:
    transformers = pytest.importorskip("transformers")
    return list(transformers.AutoConfig.for_model(**config).layer_types)


def _vllm_spec():
    pytest.importorskip("vllm", exc_type=ImportError)
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    return torch, FullAttentionSpec, MLAAttentionSpec


def test_kv_bytes_per_token_equal_vllms_page_sizes():
    torch, FullAttentionSpec, MLAAttentionSpec = _vllm_spec()
    block = 16
    mla = architecture.facts_from_config(CONFIGS["deepseek_v3"], "x", source="test")
    page = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=64 + 16, dtype=torch.bfloat16).page_size_bytes
    for tp in (1, 2, 8):  # the latent is whole on every rank
        assert kv_bytes_per_token(mla, tp, "bf16") == mla.layers * page // block
    gqa = architecture.facts_from_config(CONFIGS["qwen3"], "x", source="test")
    for tp, heads in ((1, 2), (2, 1), (4, 1)):  # 2 kv heads: split at TP 2, replicated past it
        page = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=64, dtype=torch.float32).page_size_bytes
        assert kv_bytes_per_token(gqa, tp, "fp32") == gqa.layers * page // block


@pytest.mark.parametrize("tokens, in_flight", [(1000, 0), (10, 0), (5000, 2048), (100_000, 16_384)])
def test_sliding_layers_hold_what_vllm_admits(tokens, in_flight):
    # Per layer, the pages vLLM's own specs reserve for one sequence: a full-attention layer every token,
    # a sliding one its window plus the in-flight tokens (and a page for the window's misalignment).
    torch, FullAttentionSpec, _ = _vllm_spec()
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    gemma = architecture.facts_from_config(CONFIGS["gemma3_text"], "x", source="test")
    block = 16
    common = dict(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    full = -(-tokens // block)  # a full-attention layer: every token (FullAttentionSpec: max_model_len's pages)
    window = SlidingWindowSpec(sliding_window=16, **common).max_admission_blocks_per_request(in_flight, tokens)
    page = FullAttentionSpec(**common).page_size_bytes
    expected = page * ((gemma.layers - gemma.sliding_window_layers) * full + gemma.sliding_window_layers * window)
    assert kv_sequence_bytes(gemma, 1, "bf16", tokens, block, in_flight) == expected


@pytest.mark.parametrize("config, expected", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}, ("fp8", 8 + 32 / 16384, False)),
    ({"quant_method": "mxfp4"}, ("mxfp4", 4.25, True)),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, ("int4", 4 + 20 / 128, False)),
    ({"quant_method": "gptq", "bits": 8, "group_size": 64}, ("int8", 8 + 24 / 64, False)),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}},
     ("fp8", 8, False)),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ("int4", 4.5, False)),
])
def test_quantization_config(config, expected):
    q = architecture.quantization({"quantization_config": config})
    assert (q.weights, q.bits_per_weight, q.experts_only) == expected


def test_unknown_quantization_is_one_line():
    with pytest.raises(CheckpointError) as caught:
        architecture.quantization({"quantization_config": {"quant_method": "hqq"}}, "c.json")
    assert str(caught.value) == ("c.json: quantization_config: unknown quant_method 'hqq' (lmc knows fp8, mxfp4, awq, "
                                 "gptq, compressed-tensors, bitsandbytes)")
    assert "\n" not in str(caught.value)


# --- the published configs the catalog caches ------------------------------------------------------

PUBLISHED = [path for path in sorted(catalog.MODELS_DIR.iterdir()) if (path / "config.json").is_file()]


def _published(path):
    meta = catalog._read_toml(path / "model.toml")
    return json.loads((path / "config.json").read_text()), meta


@pytest.mark.parametrize("path", PUBLISHED, ids=[p.name for p in PUBLISHED])
def test_published_configs_count_as_published_and_as_transformers_builds(path):
    config, meta = _published(path)
    facts = catalog.model_facts(meta["id"])
    published = float(meta["published"]["parameters"])
    tolerance = float(meta["published"].get("tolerance", 0.01))  # 1 %, unless the figure is a rounded size name
    assert abs(facts.parameters - published) / published <= tolerance, (facts.parameters, published)
    recorded = (meta.get("safetensors") or {}).get("parameters") or (meta.get("checkpoint") or {}).get("parameters")
    if not recorded and not config.get("_lmc_note"):
        built = transformers_parameters(config)
        # The language model exactly; a vision tower is a ViT estimate (its share of the total is small).
        tolerance = 0 if facts.vision_parameters == 0 else 0.01 * built
        assert abs(facts.parameters - built) <= tolerance, (facts.parameters, built)


def test_glm_4_7_reconstructed_config_counts_as_transformers_builds():
    # Its config.json is reconstructed (_lmc_note), so the check above skips it: built here on the meta device.
    path = catalog.MODELS_DIR / "zai-org--glm-4.7"
    config, meta = _published(path)
    assert catalog.model_facts(meta["id"]).parameters == transformers_parameters(config)


def test_a_qk_norm_over_all_heads_is_read_where_vllm_all_reduces_it():
    config = json.loads((catalog.MODELS_DIR / "minimaxai--minimax-m2.5" / "config.json").read_text())
    assert architecture.decoder_fields(config, "minimax")[0]["qk_norm_allreduce"]
    for change in ({"use_qk_norm": False}, {"qk_norm_type": "per_head"}):  # per head: each rank's heads alone
        assert not architecture.decoder_fields({**config, **change}, "minimax")[0]["qk_norm_allreduce"]
    # OLMo 2's norm spans all heads too, but vLLM 0.32 runs it through its Transformers backend (registry.py)
    assert not architecture.decoder_fields(CONFIGS["olmo2"], "olmo2")[0]["qk_norm_allreduce"]
