"""Model facts from any decoder-only config.json, read by what the config says, not by family.

A family list would have to grow with every release; these rules read the keys transformers' own
configs use for the same things:

- attention: `num_key_value_heads` (GQA/MQA), an explicit `head_dim`, MLA (`kv_lora_rank`,
  `q_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`: DeepSeek-V2/V3/R1, Kimi K2),
  biases (`attention_bias`; Qwen2's q/k/v biases; GLM-4.x MoE's on q/k/v only), q/k norms (Qwen3, Gemma 3,
  OLMo 2, MiniMax-M2; GLM-4.x MoE's where `use_qk_norm`), attention sinks (gpt-oss);
- per-layer attention kinds: `layer_types` ("sliding_attention" / "full_attention"), else
  `sliding_window_pattern` (Gemma 3: every n-th layer full), else `sliding_window` with
  `use_sliding_window` (Qwen2-style: `max_window_layers`);
- mixture of experts: the expert count under any of its names (`num_local_experts`, `num_experts`,
  `n_routed_experts`), top-k, the expert width (`moe_intermediate_size`), shared experts
  (`n_shared_experts`, `shared_expert_intermediate_size`, Llama 4's one), dense first layers
  (`first_k_dense_replace`, `mlp_only_layers`, `decoder_sparse_step`, `interleave_moe_layer_step`);
- multimodal wrappers: the language model from `text_config`, the vision tower (`vision_config`)
  counted as a ViT of its dimensions;
- the checkpoint's quantization (`quantization_config`).

`facts_from_config` turns a config dict into ModelFacts by these rules; the nine families lmc's own
layouts cut (llama, mistral, mixtral, qwen2, gptj, gpt_neox, opt, bloom, t5) keep readers of their
own key names (end of this module). Every source's config comes here once, through
planner/checkpoint_facts.py's `facts_from_answer`.

`parameters` counts what transformers builds from the config (tests/test_architecture.py builds
each committed config on the meta device and compares). Pure: no torch, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from lmc.errors import CheckpointError, InternalError, short_repr
from lmc.planner.facts import DTYPE_BYTES, ModelFacts

# model_types whose q/k/v projections carry biases without an `attention_bias` key.
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl")
# model_types with a per-head RMSNorm on queries and keys (width head_dim; OLMo 2's and MiniMax-M2's, whose
# config says qk_norm_type "per_layer", span all heads).
_QK_NORM_HEAD = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "qwen3_next")
_QK_NORM_ALL = ("olmo2", "olmo3", "minimax_m2")
# model_types whose all-heads q/k norm vLLM computes at TP > 1 with an all-reduce of the variances (ModelFacts).
_QK_NORM_TP_ALLREDUCE = ("minimax_m2",)
# model_types whose per-head q/k RMSNorm is switched by `use_qk_norm` (GLM-4.5/4.6/4.7 set it, GLM-4.5-Air not).
_QK_NORM_HEAD_IF_SET = ("glm4_moe",)
# model_types whose `attention_bias` puts biases on q/k/v only, never on o_proj.
_QKV_ONLY_BIAS_TYPES = ("glm4_moe",)
# model_types with four norms per block (before and after attention and MLP).
_FOUR_NORMS = ("gemma2", "gemma3", "gemma3_text")
_SLIDING = "sliding_attention"


# Keys published configs leave to the transformers config class's defaults (the file on the Hub omits
# them), per model_type: the defaults of that class in transformers 5.19.
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262_208, "max_position_embeddings": 131_072, "sliding_window": 4096,
                    "sliding_window_pattern": 6},
    "gpt_oss": {"sliding_window_pattern": 2},  # layer_types' default: even blocks slide, odd ones are full
}


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization as lmc plans it."""

    method: str  # quant_method as written (fp8, awq, gptq, compressed-tensors, mxfp4, bitsandbytes)
    weights: str  # lmc's name for the stored weights: fp8, int8, int4, mxfp4
    bits_per_weight: float  # including scales and zeros, averaged over the quantized weights
    experts_only: bool  # only the routed experts are quantized (gpt-oss MXFP4)
    block: int = 0  # block-wise scales: the block along a weight's output rows (fp8 weight_block_size[0])


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` of a multimodal wrapper, else the config itself.

    Keys the wrapper sets for the whole model (`architectures`, `quantization_config`, dtype,
    `tie_word_embeddings`) are kept where the text config lacks them.
    """
    text = config.get("text_config")
    if not isinstance(text, dict):
        return {**CONFIG_DEFAULTS.get(str(config.get("model_type")), {}), **config}
    merged = {**CONFIG_DEFAULTS.get(str(text.get("model_type")), {}), **text}
    for key in ("quantization_config", "torch_dtype", "dtype", "tie_word_embeddings"):
        if key in config and key not in merged:
            merged[key] = config[key]
    return merged


def quantization(config: dict[str, Any], where: str = "config.json") -> Quantization | None:
    """The checkpoint's quantization from `quantization_config`, or None; an unknown scheme is an error."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: quantization_config must be an object, got {q!r}")
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8" or method == "fbgemm_fp8":
        block = q.get("weight_block_size") or [0, 0]
        # Block-wise scales (DeepSeek-V3: one fp32 per 128 × 128 block) add 32 / block area bits.
        scale_bits = 32 / (block[0] * block[1]) if block and all(block) else 0.0
        return Quantization(method, "fp8", 8 + scale_bits, False, int(block[0]) if scale_bits else 0)
    if method == "mxfp4":
        return Quantization(method, "mxfp4", 4 + 8 / 32, True)  # 4-bit values, one 8-bit scale per 32
    if method in ("awq", "gptq", "autoround", "auto-round"):
        bits = int(q.get("bits", q.get("w_bit", 4)))
        group = int(q.get("group_size", q.get("q_group_size", 128)) or 128)
        weights = {4: "int4", 8: "int8"}.get(bits)
        if weights is None:
            raise CheckpointError(f"{where}: quantization_config: {method} with {bits} bits is not supported (4 or 8)")
        return Quantization(method, weights, bits + (16 + bits) / max(group, 1), False)  # fp16 scale + zero per group
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        first = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        weights = (first or {}).get("weights") or {}
        bits, kind = int(weights.get("num_bits", 8)), str(weights.get("type", "int"))
        name = "fp8" if kind == "float" and bits == 8 else {4: "int4", 8: "int8"}.get(bits)
        if name is None:
            raise CheckpointError(f"{where}: quantization_config: compressed-tensors with {bits}-bit {kind} "
                                  "weights is not supported")
        group = int(weights.get("group_size") or 0)
        return Quantization(method, name, bits + (16 / group if group else 0), False)
    if method == "bitsandbytes":
        if q.get("load_in_4bit"):
            return Quantization(method, "int4", 4 + 32 / 64, False)  # fp32 absmax per 64 (no double quant)
        return Quantization(method, "int8", 8 + 0.25, False)
    raise CheckpointError(f"{where}: quantization_config: unknown quant_method {method!r} "
                          "(lmc knows fp8, mxfp4, awq, gptq, compressed-tensors, bitsandbytes)")


class Reader:
    """Typed access to config keys; a missing or ill-typed required key is a one-line error."""

    _MISSING = object()

    def __init__(self, config: dict[str, Any], where: str, what: str):
        self.config, self.where, self.what = config, where, what

    def int(self, *keys: str, default: Any = _MISSING) -> Any:
        for key in keys:
            value = self.config.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise CheckpointError(f"{self.where}: `{key}` must be an integer, got {value!r}")
                return value
        if default is self._MISSING:
            raise CheckpointError(f"{self.where}: missing `{keys[0]}` (needed for a {self.what} model)")
        return default

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.where}: `{key}` must be true or false, got {value!r}")
        return value


def sliding_layers(config: dict[str, Any], layers: int) -> tuple[int | None, int]:
    """(window, how many blocks slide): (None, 0) where every block attends to the whole sequence."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None, 0
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        count = sum(1 for kind in types[:layers] if kind == _SLIDING)
        return (window, count) if count else (None, 0)
    pattern = config.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:  # Gemma 2/3: every pattern-th block is full
        count = layers - layers // pattern
        return (window, count) if count else (None, 0)
    if "use_sliding_window" in config:  # Qwen2-style: blocks from max_window_layers on slide
        if not config.get("use_sliding_window"):
            return None, 0
        first = config.get("max_window_layers")
        first = first if isinstance(first, int) else 0
        return window, max(layers - first, 0)
    return window, layers  # Mistral v0.1: every block slides


@dataclass(frozen=True)
class Moe:
    experts: int
    top_k: int
    width: int  # one routed expert's MLP width
    moe_layers: int
    shared_width: int  # the shared experts' MLP width together (0 = none)
    shared_experts: int
    dense_width: int  # MLP width of the dense blocks


def moe_layout(get: Reader, model_type: str, layers: int) -> Moe | None:
    """Experts, routing and which blocks have them; None for a dense model."""
    experts = get.int("num_local_experts", "num_experts", "n_routed_experts", default=0)
    if experts <= 1:
        return None
    top_k = get.int("num_experts_per_tok", "experts_per_token", "moe_topk", default=2)
    dense_width = get.int("intermediate_size_mlp", "intermediate_size", default=0)
    width = get.int("moe_intermediate_size", "intermediate_size")
    # Counted, not enumerated: a corrupt config's layer count (2**40) must not become a list of that many.
    moe_layers = layers
    first_dense = get.int("first_k_dense_replace", default=0)
    if first_dense:
        frequency = _at_least_one(get, "moe_layer_freq")
        # blocks first_dense, first_dense + frequency, ... below layers
        moe_layers = -(-(layers - first_dense) // frequency) if layers > first_dense else 0
    step = _at_least_one(get, "decoder_sparse_step", "interleave_moe_layer_step")
    only_dense = get.config.get("mlp_only_layers") or []
    if not isinstance(only_dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only_dense):
        raise CheckpointError(f"{get.where}: `mlp_only_layers` must list block indices, "
                              f"got {short_repr(only_dense, 60)}")
    if step > 1 or only_dense:
        # Llama 4 (interleave_moe_layer_step): every step-th block, counting from step-1; Qwen2/3-MoE: the same,
        # less the blocks mlp_only_layers keeps dense
        moe_layers = layers // step
        if "interleave_moe_layer_step" not in get.config:
            moe_layers -= len({i for i in only_dense if 0 <= i < layers and (i + 1) % step == 0})
    shared_experts = get.int("n_shared_experts", default=0)
    shared_width = shared_experts * width
    if shared_experts == 0 and get.int("shared_expert_intermediate_size", default=0):
        shared_experts, shared_width = 1, get.int("shared_expert_intermediate_size")
    if shared_experts == 0 and model_type in ("llama4", "llama4_text"):
        shared_experts, shared_width = 1, width  # Llama 4: one shared expert as wide as a routed one
    return Moe(experts, top_k, width, moe_layers, shared_width, shared_experts, dense_width)


def _at_least_one(get: Reader, *keys: str) -> int:
    """A block period (every n-th block): an integer of at least 1, 1 where absent."""
    value = get.int(*keys, default=1)
    if value < 1:
        key = next(k for k in keys if get.config.get(k) is not None)
        raise CheckpointError(f"{get.where}: `{key}` must be at least 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Counts:
    """Parameters of a decoder-only language model, by what a token reads of them."""

    total: int
    experts: int  # routed expert weights (and their biases)
    embedding: int


def decoder_fields(config: dict[str, Any], where: str) -> tuple[dict[str, Any], Counts]:
    """ModelFacts fields and parameter counts for the decoder-only language model in `config`."""
    model_type = str(config.get("model_type") or "")
    get = Reader(config, where, model_type or "decoder-only")
    h = get.int("hidden_size", "n_embd", "d_model")
    layers = get.int("num_hidden_layers", "n_layer", "num_layers")
    heads = get.int("num_attention_heads", "n_head")
    kv_heads = get.int("num_key_value_heads", default=heads)
    head_dim = get.int("head_dim", default=h // heads if heads else 0)
    vocab = get.int("vocab_size")
    inter = get.int("intermediate_size", "ffn_dim", "n_inner", default=4 * h)
    tie = get.flag("tie_word_embeddings", model_type in ("gemma", "gemma2", "gemma3", "gemma3_text"))
    window, sliding = sliding_layers(config, layers)
    moe = moe_layout(get, model_type, layers)
    bias = get.flag("attention_bias", model_type == "gpt_oss")

    kv_lora = get.int("kv_lora_rank", default=0)
    rope_dim = 0
    if kv_lora:  # MLA
        q_lora = get.int("q_lora_rank", default=0)
        rope_dim = get.int("qk_rope_head_dim")
        nope = get.int("qk_nope_head_dim")
        v_dim = get.int("v_head_dim", default=nope)
        q_width = heads * (nope + rope_dim)
        query = (h * q_lora + q_lora + q_lora * q_width) if q_lora else h * q_width
        attention = query + h * (kv_lora + rope_dim) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * h
        head_dim = nope + rope_dim
    else:
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        attention = 2 * h * q_width + 2 * h * kv_width
        if bias or model_type in _QKV_BIAS_TYPES:
            attention += q_width + 2 * kv_width
        if (bias and model_type not in _QKV_ONLY_BIAS_TYPES) or model_type == "gpt_oss":
            attention += h  # o_proj bias
        if model_type in _QK_NORM_HEAD or (model_type in _QK_NORM_HEAD_IF_SET and get.flag("use_qk_norm", False)):
            attention += 2 * head_dim
        elif model_type in _QK_NORM_ALL:
            attention += q_width + kv_width
        if model_type == "gpt_oss":
            attention += heads  # attention sinks
    norms = (4 if model_type in _FOUR_NORMS else 2) * h

    experts = 0
    if moe is None:
        mlp_total = layers * 3 * h * inter
    else:
        per_expert = 3 * h * moe.width + (2 * moe.width + h if model_type == "gpt_oss" else 0)
        # gpt-oss's router has a bias; DeepSeek's e_score_correction_bias is a buffer, not a parameter.
        router = h * moe.experts + (moe.experts if model_type == "gpt_oss" else 0)
        shared = 3 * h * moe.shared_width + (h if "shared_expert_intermediate_size" in config else 0)
        experts = moe.moe_layers * moe.experts * per_expert
        mlp_total = experts + moe.moe_layers * (router + shared) + (layers - moe.moe_layers) * 3 * h * moe.dense_width
    embedding = vocab * h
    total = embedding + layers * (attention + norms) + mlp_total + h + (0 if tie else vocab * h)

    fields: dict[str, Any] = dict(
        layers=layers, hidden_size=h, attention_heads=heads, kv_heads=1 if kv_lora else kv_heads, head_dim=head_dim,
        intermediate_size=moe.width if moe else inter, vocab_size=vocab,
        max_position_embeddings=get.int("max_position_embeddings", "n_positions", default=None),
        tie_word_embeddings=tie, kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dim,
        sliding_window=window, sliding_window_layers=sliding,
        qk_norm_allreduce=model_type in _QK_NORM_TP_ALLREDUCE and get.flag("use_qk_norm", True)
        and config.get("qk_norm_type", "per_layer") == "per_layer",
    )
    if moe is not None:
        fields.update(num_experts=moe.experts, experts_per_token=moe.top_k, shared_experts=moe.shared_experts,
                      shared_expert_width=moe.shared_width, moe_layers=moe.moe_layers,
                      dense_intermediate_size=moe.dense_width if moe.moe_layers < layers else 0)
    return fields, Counts(total=total, experts=experts, embedding=embedding)


def vision_parameters(config: dict[str, Any], text_hidden: int) -> int:
    """A multimodal wrapper's parameters outside the language model: a ViT of `vision_config`'s
    dimensions (patch embedding, position embeddings, blocks with biases, norms) and a projector."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    h = int(vision.get("hidden_size", 0) or 0)
    if not h:
        return 0
    layers = int(vision.get("num_hidden_layers", 0) or 0)
    inter = int(vision.get("intermediate_size", 4 * h) or 4 * h)
    patch = int(vision.get("patch_size", 14) or 14)
    channels = int(vision.get("num_channels", 3) or 3)
    image = int(vision.get("image_size", 224) or 224)
    positions = (image // patch) ** 2
    block = 4 * h * h + 4 * h + 2 * h * inter + inter + h + 4 * h
    projector = h * text_hidden + h
    # SigLIP's attention-pooling head (probe, attention, norm, MLP) where the config keeps it.
    head = (h + 4 * h * h + 4 * h + 2 * h + 2 * h * inter + inter + h
            if vision.get("model_type", "siglip_vision_model") == "siglip_vision_model"
            and vision.get("vision_use_head", True) else 0)
    return channels * patch * patch * h + h + positions * h + layers * block + 2 * h + head + projector


def checkpoint_weight_bytes(total: int, experts: int, embedding: int, tied: bool, q: Quantization,
                            plain_bytes: float) -> int:
    """The bytes of a quantized checkpoint computed from its config (when no safetensors metadata is
    at hand): the quantized weights at their bits (scales included), embeddings and the rest at
    `plain_bytes` (bf16)."""
    if q.experts_only:
        quantized = experts
    else:  # every matrix but the embedding and LM head (what quantizers leave alone)
        quantized = total - embedding * (1 if tied else 2)
    return int(quantized * q.bits_per_weight / 8 + (total - quantized) * plain_bytes)


# --- config.json -> ModelFacts: the rules above, and the nine families' own key names --------------

# model_type (config.json) -> family. The HF class prefix is the fallback for configs without one.
MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mixtral",
    "qwen2": "qwen2",
    "gptj": "gptj",
    "gpt_neox": "gpt_neox",
    "opt": "opt",
    "bloom": "bloom",
    "t5": "t5",
}
_ARCHITECTURE_PREFIXES: dict[str, str] = {
    "LlamaFor": "llama",
    "MistralFor": "mistral",
    "MixtralFor": "mixtral",
    "Qwen2For": "qwen2",
    "GPTJFor": "gptj",
    "GPTNeoXFor": "gpt_neox",
    "OPTFor": "opt",
    "BloomFor": "bloom",
    "T5For": "t5",
}

_CONFIG_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32"}


def architectures_of(config: dict[str, Any], config_file: Path | str = "config.json") -> list[str]:
    """The config's `architectures` (class names; [] where absent), or a CheckpointError for anything else."""
    architectures = config.get("architectures")
    if architectures is None:
        return []
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise CheckpointError(f"{config_file}: architectures must list class names (e.g. [\"LlamaForCausalLM\"]), "
                              f"not {short_repr(architectures, 60)}")
    return architectures


def family_of(config: dict[str, Any], config_file: Path | str = "config.json") -> str:
    """lmc's layout family of an HF config (from `model_type`, else `architectures`), else its
    model_type: any decoder-only architecture is planned from its config."""
    model_type = config.get("model_type")
    architectures = architectures_of(config, config_file)
    if isinstance(model_type, str) and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    for architecture in architectures:
        for prefix, family in _ARCHITECTURE_PREFIXES.items():
            if architecture.startswith(prefix):
                return family
    if isinstance(model_type, str) and re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", model_type):
        return model_type
    shown = model_type if model_type is not None else (architectures or ["(none)"])[0]
    raise CheckpointError(f"{config_file}: model_type {shown!r} is not a Hugging Face model type "
                          "(config.json needs `model_type`, e.g. \"llama\" or \"qwen3\")")


def facts_from_config(config: dict[str, Any], model_id: str, *, source: str,
                      config_file: Path | str = "config.json") -> ModelFacts:
    """ModelFacts from an HF config dict; the parameter count is computed from the dimensions."""
    family = family_of(config, config_file)
    where = str(config_file)
    architectures = architectures_of(config, config_file)
    text = text_config(config)
    q = quantization(config, where)
    fields: dict[str, Any] = {}
    if family in _FAMILY_FIELDS:
        fields = _FAMILY_FIELDS[family](_Getter(config, config_file, family))
        window, sliding = sliding_layers(config, fields["layers"])
        fields.update(sliding_window=window, sliding_window_layers=sliding)
        counts = None
    else:
        fields, counts = decoder_fields(text, where)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "float16"
    fields.update(
        id=model_id,
        family=family,
        architecture=architectures[0] if architectures else family,
        torch_dtype=_CONFIG_DTYPE.get(str(dtype), "fp16"),
        source=source,
        parameters=1,
    )
    try:
        facts = ModelFacts(**fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where_in = ".".join(str(part) for part in error["loc"])
        raise CheckpointError(f"{config_file}: {where_in}: {error['msg']}") from None
    if counts is None:
        total, experts, embedding = estimate_parameters(facts, gated_ffn=_t5_gated(config)), facts.routed_experts, 0
    else:
        total, experts, embedding = counts.total, counts.experts, counts.embedding
    vision = vision_parameters(config, facts.hidden_size) if text is not config else 0
    active = total - experts + experts * facts.experts_per_token // max(facts.num_experts, 1) if experts else 0
    mtp = Reader(text, str(config_file), family).int("num_nextn_predict_layers", default=0)
    if mtp < 0:
        raise CheckpointError(f"{config_file}: `num_nextn_predict_layers` must not be negative, got {mtp}")
    update: dict[str, Any] = {"mtp_layers": mtp,
                              "parameters": total + vision, "expert_parameters": experts,
                              "active_parameters": active + vision if experts else 0, "vision_parameters": vision}
    if q is not None:
        plain = checkpoint_weight_bytes(total + vision, experts, embedding or facts.vocab_size * facts.hidden_size,
                                                     facts.tie_word_embeddings, q, DTYPE_BYTES.get(facts.torch_dtype, 2))
        update.update(checkpoint_quantization=q.weights, quantization_method=q.method, checkpoint_weight_bytes=plain,
                      quantization_block=q.block)
    return facts.model_copy(update=update)


class _Getter(Reader):
    """Reader in the family readers' call shape, get("key", "alias", default=...)."""

    def __init__(self, config: dict[str, Any], config_file: Path | str, family: str):
        super().__init__(config, str(config_file), family)
        self.family, self.config_file = family, config_file

    __call__ = Reader.int


def _decoder_only(get: _Getter) -> dict[str, Any]:
    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    fields = dict(
        layers=get("num_hidden_layers"), hidden_size=hidden, attention_heads=heads,
        kv_heads=get("num_key_value_heads", default=heads),
        head_dim=get("head_dim", default=hidden // heads if heads else 0),
        intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings", default=None),
        tie_word_embeddings=get.flag("tie_word_embeddings", False),
    )
    if get.family == "mixtral":
        fields.update(num_experts=get("num_local_experts"), experts_per_token=get("num_experts_per_tok"))
    return fields


def _gptj(get: _Getter) -> dict[str, Any]:
    hidden, heads = get("n_embd"), get("n_head")
    return dict(
        layers=get("n_layer"), hidden_size=hidden, attention_heads=heads, kv_heads=heads,
        head_dim=hidden // heads if heads else 0, intermediate_size=get("n_inner", default=4 * hidden),
        vocab_size=get("vocab_size"), max_position_embeddings=get("n_positions", default=None),
        tie_word_embeddings=get.flag("tie_word_embeddings", False),
    )


def _gpt_neox(get: _Getter) -> dict[str, Any]:
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    return dict(
        layers=get("num_hidden_layers"), hidden_size=hidden, attention_heads=heads, kv_heads=heads,
        head_dim=hidden // heads if heads else 0, intermediate_size=get("intermediate_size", default=4 * hidden),
        vocab_size=get("vocab_size"), max_position_embeddings=get("max_position_embeddings", default=None),
        tie_word_embeddings=get.flag("tie_word_embeddings", False),
    )


def _opt(get: _Getter) -> dict[str, Any]:
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    projected = get("word_embed_proj_dim", default=hidden)
    if projected != hidden:
        # OPT-350m projects a narrower embedding; lmc's layouts and math assume the two are equal.
        raise CheckpointError(f"{get.config_file}: word_embed_proj_dim ({projected}) differs from hidden_size "
                              f"({hidden}); lmc supports OPT models whose embedding width equals hidden_size")
    return dict(
        layers=get("num_hidden_layers"), hidden_size=hidden, attention_heads=heads, kv_heads=heads,
        head_dim=hidden // heads if heads else 0, intermediate_size=get("ffn_dim"),
        vocab_size=get("vocab_size"), max_position_embeddings=get("max_position_embeddings", default=None),
        tie_word_embeddings=get.flag("tie_word_embeddings", True),
    )


def _bloom(get: _Getter) -> dict[str, Any]:
    hidden, heads = get("hidden_size", "n_embed"), get("n_head", "num_attention_heads")
    return dict(
        layers=get("n_layer", "num_hidden_layers"), hidden_size=hidden, attention_heads=heads, kv_heads=heads,
        head_dim=hidden // heads if heads else 0, intermediate_size=4 * hidden, vocab_size=get("vocab_size"),
        max_position_embeddings=None,  # ALiBi: no learned or rotary position limit
        tie_word_embeddings=get.flag("tie_word_embeddings", True),
    )


def _t5(get: _Getter) -> dict[str, Any]:
    heads, encoder_layers = get("num_heads"), get("num_layers")
    return dict(
        is_encoder_decoder=True, layers=get("num_decoder_layers", default=encoder_layers),
        encoder_layers=encoder_layers, hidden_size=get("d_model"), attention_heads=heads, kv_heads=heads,
        head_dim=get("d_kv"), intermediate_size=get("d_ff"), vocab_size=get("vocab_size"),
        max_position_embeddings=None,  # relative position buckets: no fixed limit
        tie_word_embeddings=get.flag("tie_word_embeddings", True),
    )


_FAMILY_FIELDS: dict[str, Callable[[_Getter], dict[str, Any]]] = {
    "llama": _decoder_only, "mistral": _decoder_only, "mixtral": _decoder_only, "qwen2": _decoder_only,
    "gptj": _gptj, "gpt_neox": _gpt_neox, "opt": _opt, "bloom": _bloom, "t5": _t5,
}


def _t5_gated(config: dict[str, Any]) -> bool:
    # T5 v1.1 / FLAN / UL2 use a gated FFN (wi_0, wi_1); the original T5 does not.
    return str(config.get("feed_forward_proj", "relu")).startswith("gated")


def estimate_parameters(facts: ModelFacts, *, gated_ffn: bool = True) -> int:
    """The parameter count implied by the architecture's dimensions (exact for the HF implementations).

    `gated_ffn` matters only for T5 (FLAN-T5 and UL2 are gated; the original T5 is not).
    """
    h, v, inner = facts.hidden_size, facts.vocab_size, facts.intermediate_size
    q_width, kv_width = facts.attention_heads * facts.head_dim, facts.kv_heads * facts.head_dim
    head = 0 if facts.tie_word_embeddings else v * h
    family = facts.family
    if family in ("llama", "mistral", "qwen2", "mixtral"):
        attention = h * q_width * 2 + h * kv_width * 2
        if family == "qwen2":
            attention += q_width + 2 * kv_width  # q/k/v biases
        if family == "mixtral":
            mlp = facts.num_experts * 3 * h * inner + h * facts.num_experts  # experts + router
        else:
            mlp = 3 * h * inner
        return v * h + facts.layers * (attention + mlp + 2 * h) + h + head
    if family == "gptj":
        layer = 2 * h + 4 * h * h + (h * inner + inner) + (inner * h + h)
        return v * h + facts.layers * layer + 2 * h + (0 if facts.tie_word_embeddings else v * h + v)
    if family in ("gpt_neox", "bloom", "opt"):
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
        if family == "opt":  # separate q, k, v projections: same count as a fused qkv
            positions = ((facts.max_position_embeddings or 0) + 2) * h  # OPT's learned positions, offset 2
            return v * h + positions + facts.layers * layer + 2 * h + head
        extra = 2 * h if family == "bloom" else 0  # BLOOM's embedding LayerNorm
        return v * h + extra + facts.layers * layer + 2 * h + head
    if family == "t5":
        attention = 4 * h * q_width
        ffn = (3 if gated_ffn else 2) * h * inner
        relative_bias = 32 * facts.attention_heads  # 32 buckets, first layer of each stack
        encoder = facts.encoder_layers * (attention + ffn + 2 * h) + relative_bias + h
        decoder = facts.layers * (2 * attention + ffn + 3 * h) + relative_bias + h
        return v * h + encoder + decoder + head
    raise InternalError(f"no parameter formula for family {family!r}")
