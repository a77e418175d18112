"""Model facts from a config.json and a safetensors tensor list, wherever they were read.

Every source of a model's facts (lmc/model_sources.py: a local checkpoint, the Hub, the HF cache, the
catalog) answers with an `Answer`: the config dict, where it came from, and its weights' tensors.
`facts_from_answer` is the one place such an answer becomes `ModelFacts`: the config's fields by
planner/architecture.py's rules (`facts_from_config`), then the tensors (`with_tensors`).

This module also reads a local checkpoint (`local_answer`): its config.json and its safetensors
headers, nothing else. A safetensors file is an 8-byte little-endian header length, a JSON header
naming every tensor's dtype, shape and byte range, then the raw data. Reading the headers gives the
exact parameter count and the stored dtype of a checkpoint of any size in milliseconds; tensor data
is never read.
"""

from __future__ import annotations

import json
import re
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import ValidationError

from lmc.errors import CheckpointError, InternalError
from lmc.planner import architecture
from lmc.planner.facts import DTYPE_BYTES, ModelFacts
from lmc.safetensors_header import DTYPES as ST_DTYPES, HeaderError, read_header

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

# safetensors dtype -> lmc dtype name.
_ST_DTYPE = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F8_E4M3": "fp8", "F8_E5M2": "fp8", "I8": "int8"}
_CONFIG_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32"}


Tensor = tuple[str, str, tuple[int, ...]]  # a safetensors tensor: name, dtype ("BF16"), shape


@dataclass(frozen=True)
class Weights:
    """A checkpoint's weights as a source read them."""

    tensors: Sequence[Tensor] | None  # None: none read (the parameters are the config's)
    note: str = ""  # what the facts' `source` adds about them


@dataclass(frozen=True)
class Answer:
    """What one source found of a model: its config.json, where it came from, and its weights."""

    model_id: str  # the id the facts carry
    config: dict[str, Any]
    config_file: Path | str  # what an error in the config names
    source: str  # where the facts came from (ModelFacts.source, before the weights' note)
    # Read after the config is checked: a bad config is the first error a user sees, as from a checkpoint.
    weights: Callable[[], Weights]
    stated: dict[str, Any] = field(default_factory=dict)  # facts the source states outright, set last


def facts_from_answer(answer: Answer) -> ModelFacts:
    """The ModelFacts of a source's answer: the config's fields (architecture.py), then its tensors."""
    facts = facts_from_config(answer.config, answer.model_id, source=answer.source, config_file=answer.config_file)
    weights = answer.weights()
    if weights.tensors is not None:
        facts = with_tensors(facts, list(weights.tensors))
    return facts.model_copy(update={**answer.stated, "source": answer.source + weights.note})


def checkpoint_model_facts(path: Path, model_id: str) -> ModelFacts:
    """The facts of the HF checkpoint in directory `path`: dims from config.json, counts from headers."""
    return facts_from_answer(local_answer(path, model_id))


def local_answer(path: Path, model_id: str) -> Answer:
    """The HF checkpoint in directory `path` as a source's answer: its config.json, its safetensors headers."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    config = read_config(path / "config.json")
    return Answer(model_id=model_id, config=config, config_file=path / "config.json", source=str(path),
                  weights=lambda: _local_weights(path))


def _local_weights(path: Path) -> Weights:
    files = safetensors_files(path)
    if not files:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            return Weights(None, " (config.json; parameter count estimated from its dimensions: the weights "
                                 "are pickle *.bin files, which lmc does not read and refuses to build from unless "
                                 "--allow-pickle)")
        raise CheckpointError(f"{path}: no *.safetensors weights (pickle *.bin checkpoints are refused unless --allow-pickle)")
    tensors = [entry for file in files for entry in read_safetensors_header(file)]
    if not tensors:
        raise CheckpointError(f"{files[0]}: the safetensors files hold no tensors")
    return Weights(tensors)


def with_tensors(facts: ModelFacts, tensors: list[Tensor]) -> ModelFacts:
    """`facts` made exact by the checkpoint's tensors (name, safetensors dtype, shape): the parameter
    count and stored dtype of a 16/32-bit checkpoint, the weight bytes of a quantized one (whose
    packed elements and scales are not parameters: its count stays the config's)."""
    parameters, weight_bytes, dtype_elements = 0, 0, Counter()
    for _, dtype, shape in tensors:
        count = math.prod(shape)
        parameters += count
        weight_bytes += count * (ST_DTYPES[dtype].size if dtype in ST_DTYPES else 2)
        if dtype in _ST_DTYPE and _ST_DTYPE[dtype] in ("fp32", "fp16", "bf16"):
            dtype_elements[_ST_DTYPE[dtype]] += count
    update: dict[str, Any] = {}
    if facts.checkpoint_quantization is None:
        update["parameters"] = parameters
    else:
        update["checkpoint_weight_bytes"] = weight_bytes
    if dtype_elements:
        update["torch_dtype"] = dtype_elements.most_common(1)[0][0]
    if facts.expert_parameters and facts.checkpoint_quantization is None:
        # The experts are the config's (their shapes are exact); what the exact total adds is outside them.
        experts = facts.expert_parameters
        update["active_parameters"] = parameters - experts + experts * facts.experts_per_token // facts.num_experts
    return facts.model_copy(update=update)


def read_config(config_file: Path) -> dict[str, Any]:
    """config.json as a dict, or a one-line CheckpointError naming the file."""
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing (a HF checkpoint directory needs its config.json)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({_one_line(exc)})") from None
    except RecursionError:
        raise CheckpointError(f"{config_file}: not valid JSON (nested too deeply)") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    return config


def family_of(config: dict[str, Any], config_file: Path | str = "config.json") -> str:
    """lmc's layout family of an HF config (from `model_type`, else `architectures`), else its
    model_type: any decoder-only architecture is planned from its config."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    for architecture in config.get("architectures") or []:
        for prefix, family in _ARCHITECTURE_PREFIXES.items():
            if isinstance(architecture, str) and architecture.startswith(prefix):
                return family
    if isinstance(model_type, str) and re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", model_type):
        return model_type
    shown = model_type if model_type is not None else (config.get("architectures") or ["(none)"])[0]
    raise CheckpointError(f"{config_file}: model_type {shown!r} is not a Hugging Face model type "
                          "(config.json needs `model_type`, e.g. \"llama\" or \"qwen3\")")


def facts_from_config(config: dict[str, Any], model_id: str, *, source: str,
                      config_file: Path | str = "config.json") -> ModelFacts:
    """ModelFacts from an HF config dict; the parameter count is computed from the dimensions."""
    family = family_of(config, config_file)
    where = str(config_file)
    architectures = config.get("architectures") or []
    text = architecture.text_config(config)
    q = architecture.quantization(config, where)
    fields: dict[str, Any] = {}
    if family in _FAMILY_FIELDS:
        fields = _FAMILY_FIELDS[family](_Getter(config, config_file, family))
        window, sliding = architecture.sliding_layers(config, fields["layers"])
        fields.update(sliding_window=window, sliding_window_layers=sliding)
        counts = None
    else:
        fields, counts = architecture.decoder_fields(text, where)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "float16"
    fields.update(
        id=model_id,
        family=family,
        architecture=architectures[0] if architectures and isinstance(architectures[0], str) else family,
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
    vision = architecture.vision_parameters(config, facts.hidden_size) if text is not config else 0
    active = total - experts + experts * facts.experts_per_token // max(facts.num_experts, 1) if experts else 0
    update: dict[str, Any] = {"mtp_layers": int(text.get("num_nextn_predict_layers") or 0),
                              "parameters": total + vision, "expert_parameters": experts,
                              "active_parameters": active + vision if experts else 0, "vision_parameters": vision}
    if q is not None:
        plain = architecture.checkpoint_weight_bytes(total + vision, experts, embedding or facts.vocab_size * facts.hidden_size,
                                                     facts.tie_word_embeddings, q, DTYPE_BYTES.get(facts.torch_dtype, 2))
        update.update(checkpoint_quantization=q.weights, quantization_method=q.method, checkpoint_weight_bytes=plain)
    return facts.model_copy(update=update)


class _Getter(architecture.Reader):
    """architecture.Reader in the family readers' call shape, get("key", "alias", default=...)."""

    def __init__(self, config: dict[str, Any], config_file: Path | str, family: str):
        super().__init__(config, str(config_file), family)
        self.family, self.config_file = family, config_file

    __call__ = architecture.Reader.int


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


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names when sharded, else every *.safetensors."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to file names")
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CheckpointError(f"{index_file}: not a safetensors index (needs a `weight_map` object): "
                                  f"{_one_line(exc)}") from None
        files = [path / name for name in names]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (listed in {index_file.name})")
        return files
    files = sorted(path.glob("*.safetensors"))
    for file in files:  # a fifo or a device would block the header read forever
        if not file.is_file():
            raise CheckpointError(f"{file}: not a regular file")
    # Without an index, shard names say how many there are: a partial download must not plan as a
    # smaller model (its headers hold only part of the parameters).
    for file in files:
        match = re.fullmatch(r"(.*)-(\d+)-of-(\d+)\.safetensors", file.name)
        if match:
            stem, width, total = match.group(1), len(match.group(2)), int(match.group(3))
            for number in range(1, total + 1):
                sibling = path / f"{stem}-{number:0{width}d}-of-{match.group(3)}.safetensors"
                if not sibling.is_file():
                    raise CheckpointError(f"{sibling}: missing ({file.name} says the checkpoint has {total} shards)")
    return files


def read_safetensors_header(file: Path) -> list[Tensor]:
    """(name, dtype, shape) of every tensor in `file`, checked against the file size; data never read."""
    try:
        header = read_header(file)
    except HeaderError as exc:
        raise CheckpointError(f"{file}: corrupt safetensors file: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc.strerror or exc}") from None
    return [(name, entry.dtype, entry.shape) for name, entry in header.tensors.items()]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
