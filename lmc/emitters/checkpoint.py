"""Checkpoint validation: everything about a local HF checkpoint that can be checked before any
weight is read, checked, with one-line errors that name the file.

`validate_checkpoint(path, facts)` checks, in order: the directory; config.json; the weight files
(safetensors, single or sharded through model.safetensors.index.json, every file the index names
present and holding the tensors the index says); each safetensors header against its file
(lmc.emitters.safetensors_stream.read_header); every tensor the tensor-parallel layout touches
(and the embeddings) against the shapes config.json implies; the tokenizer files. It returns a
`CheckpointInfo` the partitioner streams from.

Pickle checkpoints (`*.bin`, `*.pt`) can run arbitrary code when loaded, so they are refused unless
the caller passes `allow_pickle=True`; then each file is loaded with `torch.load(weights_only=True)`
and rewritten as safetensors in a temporary directory (removed at exit), and validated like any other.
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from lmc.emitters.safetensors_stream import Header, StreamingWriter, dtype_code, read_header
from lmc.errors import CheckpointError
from lmc.manifest import TOKENIZER_MODELS
from lmc.planner.checkpoint_facts import safetensors_files
from lmc.planner.facts import ModelFacts

INDEX_NAME = "model.safetensors.index.json"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
PICKLE_REFUSAL = "pass --allow-pickle to load pickle checkpoints (they can run arbitrary code)"

# Copied with the tokenizer when present.
_TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                     "chat_template.json")
_OTHER_EXTRAS = ("generation_config.json",)


class TensorInfo(NamedTuple):
    """Where a tensor lives: its file, safetensors dtype code, shape and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]


@dataclass(frozen=True)
class CheckpointInfo:
    """A validated checkpoint. Paths in `tokenizer_files` / `extra_files` are relative to `path`."""

    path: Path
    family: str
    files: tuple[Path, ...]  # the safetensors files holding the weights (converted copies for pickle input)
    tensors: dict[str, TensorInfo] = field(repr=False)
    tokenizer_files: tuple[str, ...]
    extra_files: tuple[str, ...]  # everything to copy next to config.json: generation config and tokenizer files
    from_pickle: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(t.offsets[1] - t.offsets[0] for t in self.tensors.values())

    @property
    def largest_tensor_bytes(self) -> int:
        return max((t.offsets[1] - t.offsets[0] for t in self.tensors.values()), default=0)


def validate_checkpoint(path: Path, facts: ModelFacts, *, allow_pickle: bool = False,
                        quantized: bool = False) -> CheckpointInfo:
    """Check the checkpoint in directory `path` against `facts` (from its config.json). Reads no weights.

    `quantized`: the plan serves the checkpoint in its own quantization (vLLM): its packed tensors and
    scales are expected, and their shapes are the quantizer's, not the config's."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing (a HF checkpoint directory needs its config.json)")
    config = _read_json(config_file)
    if isinstance(config, dict) and config.get("quantization_config") and not quantized:
        method = (config["quantization_config"] or {}).get("quant_method", "?") \
            if isinstance(config["quantization_config"], dict) else "?"
        raise CheckpointError(f"{config_file}: the checkpoint is already quantized (quantization_config, method "
                              f"{method}); lmc builds from 16- or 32-bit float weights and quantizes them itself")
    files, from_pickle = _weight_files(path, allow_pickle)
    headers = [read_header(file) for file in files]
    tensors = _tensor_table(path, headers)
    _check_index_agrees(path, tensors)
    if not quantized:
        _check_not_quantized(tensors)
        check_shapes(facts, tensors)
    check_complete(path, facts, tensors)
    tokenizer_files = _tokenizer_files(path)
    extras = sorted(set(tokenizer_files) | {name for name in _OTHER_EXTRAS if (path / name).is_file()})
    _check_json_files(path, extras)
    return CheckpointInfo(path=path, family=facts.family, files=tuple(files), tensors=tensors,
                          tokenizer_files=tuple(tokenizer_files), extra_files=tuple(extras), from_pickle=from_pickle)


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({' '.join(str(exc).split())})") from None
    except RecursionError:
        raise CheckpointError(f"{file}: not valid JSON (nested too deeply)") from None


def _check_json_files(path: Path, names: list[str]) -> None:
    """The JSON files the artifact will carry (tokenizer, generation config) as the runtime reads them:
    each a JSON object, tokenizer.json one the `tokenizers` library loads. A broken one found here is a
    one-line build error, not a serving container that restarts its workers forever."""
    for name in names:
        if not name.endswith(".json"):
            continue
        data = _read_json(path / name)
        if not isinstance(data, dict):
            raise CheckpointError(f"{path / name}: expected a JSON object, got {type(data).__name__}")
    if "tokenizer.json" in names:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # the engines extra brings it; without it the JSON check above is all
            return
        try:
            Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the library's own message: a bad model section, an unknown type
            raise CheckpointError(f"{path / 'tokenizer.json'}: the tokenizers library cannot load it "
                                  f"({' '.join(str(exc).split())[:200]})") from None


def _weight_files(path: Path, allow_pickle: bool) -> tuple[list[Path], bool]:
    # The planner's reader: the files the index names, else every *.safetensors (shard sets complete).
    files = safetensors_files(path)
    if files:
        return files, False
    if (path / INDEX_NAME).is_file():
        raise CheckpointError(f"{path / INDEX_NAME}: the weight_map names no files")
    # HF's pickle weight names only: a fine-tune directory also holds training_args.bin, optimizer.pt...
    pickles = sorted(p for p in path.iterdir() if p.is_file() and re.fullmatch(r"pytorch_model.*\.bin", p.name))
    if not pickles:
        raise CheckpointError(f"{path}: no weights: expected *.safetensors (or {INDEX_NAME})")
    if not allow_pickle:
        raise CheckpointError(f"{pickles[0]}: the checkpoint has only pickle weights; {PICKLE_REFUSAL}")
    return _convert_pickles(path, pickles), True


def _weight_map(index: Path) -> dict[str, str]:
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: not a weights index: needs a `weight_map` object of tensor -> file")
    return weight_map


def _tensor_table(path: Path, headers: list[Header]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for header in headers:
        for name, entry in header.tensors.items():
            if name in tensors:
                raise CheckpointError(f"{header.path}: tensor {name!r} is also in {tensors[name].file.name}")
            tensors[name] = TensorInfo(header.path, entry.dtype, entry.shape, (entry.begin, entry.end))
    if not tensors:
        raise CheckpointError(f"{headers[0].path if headers else path}: the weight files hold no tensors")
    return dict(sorted(tensors.items()))


def _check_index_agrees(path: Path, tensors: dict[str, TensorInfo]) -> None:
    index = path / INDEX_NAME
    if not index.is_file():
        return
    for name, file_name in sorted(_weight_map(index).items()):
        if name not in tensors:
            raise CheckpointError(f"{path / file_name}: has no tensor {name!r} ({index.name} says it does)")
        if tensors[name].file.name != file_name:
            raise CheckpointError(f"{tensors[name].file}: holds {name!r}, but {index.name} places it in {file_name}")


def _dims(f: ModelFacts) -> dict[str, int]:
    return dict(V=f.vocab_size, H=f.hidden_size, A=f.attention_heads * f.head_dim, K=f.kv_heads * f.head_dim,
                I=f.intermediate_size, E=f.num_experts, N=f.attention_heads)


def _rules(*rules: tuple[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(pattern), spec) for pattern, spec in rules]


# Expected shapes per family: pattern -> dims as letters from _dims ("3A" = three times A; "_" = not checked).
_LLAMA = _rules(
    (r"embed_tokens\.weight$", "V H"), (r"^lm_head\.weight$", "V H"),
    (r"\.self_attn\.q_proj\.weight$", "A H"), (r"\.self_attn\.q_proj\.bias$", "A"),
    (r"\.self_attn\.[kv]_proj\.weight$", "K H"), (r"\.self_attn\.[kv]_proj\.bias$", "K"),
    (r"\.self_attn\.o_proj\.weight$", "H A"),
    (r"\.mlp\.(gate_proj|up_proj)\.weight$", "I H"), (r"\.mlp\.down_proj\.weight$", "H I"),
    (r"\.experts\.\d+\.(w1|w3)\.weight$", "I H"), (r"\.experts\.\d+\.w2\.weight$", "H I"),
    (r"\.block_sparse_moe\.gate\.weight$", "E H"),
)
SHAPE_RULES: dict[str, list[tuple[re.Pattern, str]]] = {
    "llama": _LLAMA, "mistral": _LLAMA, "mixtral": _LLAMA, "qwen2": _LLAMA,
    "gptj": _rules(
        (r"\.wte\.weight$", "V H"), (r"^lm_head\.weight$", "V H"), (r"^lm_head\.bias$", "V"),
        (r"\.attn\.[qkv]_proj\.weight$", "A H"), (r"\.attn\.out_proj\.weight$", "H A"),
        (r"\.mlp\.fc_in\.weight$", "I H"), (r"\.mlp\.fc_in\.bias$", "I"), (r"\.mlp\.fc_out\.weight$", "H I"),
    ),
    "gpt_neox": _rules(
        (r"embed_in\.weight$", "V H"), (r"^embed_out\.weight$", "V H"),
        (r"\.attention\.query_key_value\.weight$", "3A H"), (r"\.attention\.query_key_value\.bias$", "3A"),
        (r"\.attention\.dense\.weight$", "H A"),
        (r"\.mlp\.dense_h_to_4h\.weight$", "I H"), (r"\.mlp\.dense_h_to_4h\.bias$", "I"),
        (r"\.mlp\.dense_4h_to_h\.weight$", "H I"),
    ),
    "opt": _rules(
        (r"embed_tokens\.weight$", "V H"), (r"^lm_head\.weight$", "V H"), (r"embed_positions\.weight$", "_ H"),
        (r"\.self_attn\.[qkv]_proj\.weight$", "A H"), (r"\.self_attn\.[qkv]_proj\.bias$", "A"),
        (r"\.self_attn\.out_proj\.weight$", "H A"),
        (r"\.fc1\.weight$", "I H"), (r"\.fc1\.bias$", "I"), (r"\.fc2\.weight$", "H I"),
    ),
    "bloom": _rules(
        (r"word_embeddings\.weight$", "V H"), (r"^lm_head\.weight$", "V H"),
        (r"\.self_attention\.query_key_value\.weight$", "3A H"), (r"\.self_attention\.query_key_value\.bias$", "3A"),
        (r"\.self_attention\.dense\.weight$", "H A"),
        (r"\.mlp\.dense_h_to_4h\.weight$", "I H"), (r"\.mlp\.dense_h_to_4h\.bias$", "I"),
        (r"\.mlp\.dense_4h_to_h\.weight$", "H I"),
    ),
    "t5": _rules(
        (r"^shared\.weight$", "V H"), (r"embed_tokens\.weight$", "V H"), (r"^lm_head\.weight$", "V H"),
        (r"\.(SelfAttention|EncDecAttention)\.[qkv]\.weight$", "A H"),
        (r"\.(SelfAttention|EncDecAttention)\.o\.weight$", "H A"),
        (r"\.relative_attention_bias\.weight$", "_ N"),
        (r"\.DenseReluDense\.(wi|wi_0|wi_1)\.weight$", "I H"), (r"\.DenseReluDense\.wo\.weight$", "H I"),
    ),
}
_NAMES = {"V": "vocab_size", "H": "hidden_size", "A": "heads·head_dim", "K": "kv_heads·head_dim",
          "I": "intermediate_size", "E": "num_experts", "N": "heads", "_": "any"}
# A layer's tensors: (the stack, e.g. "model.layers" or "encoder.block", the layer index, the rest).
_STACK = re.compile(r"^((?:[^.]+\.)*?(?:layers|h|block))\.(\d+)\.(.+)$")


def _stack_layers(facts: ModelFacts, stack: str) -> int:
    """How many layers config.json gives the stack (T5's encoder has its own count)."""
    return facts.encoder_layers if stack.startswith("encoder.") else facts.layers


def expected_shape(facts: ModelFacts, name: str) -> tuple[tuple[int | None, ...], str] | None:
    """The shape config.json implies for tensor `name` (None dims unchecked) and its description."""
    dims = _dims(facts)
    for pattern, spec in SHAPE_RULES.get(facts.family, ()):
        if pattern.search(name):
            shape, words = [], []
            for token in spec.split():
                factor, letter = (int(token[:-1]), token[-1]) if len(token) > 1 else (1, token)
                shape.append(None if letter == "_" else factor * dims[letter])
                words.append(("3·" if factor == 3 else "") + _NAMES[letter])
            return tuple(shape), " × ".join(words)
    return None


def check_shapes(facts: ModelFacts, tensors: dict[str, TensorInfo]) -> None:
    """Every tensor the layout or the embeddings touch has the shape config.json implies."""
    for name, tensor in tensors.items():
        expected = expected_shape(facts, name)
        if expected is not None:
            shape, words = expected
            if len(shape) != len(tensor.shape) or any(e is not None and e != d for e, d in zip(shape, tensor.shape)):
                shown = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
                raise CheckpointError(f"{tensor.file}: tensor {name!r} has shape {list(tensor.shape)}, but config.json "
                                      f"implies {shown} ({words})")
        match = _STACK.match(name)
        if match:
            limit = _stack_layers(facts, match.group(1))
            if int(match.group(2)) >= limit:
                raise CheckpointError(f"{tensor.file}: tensor {name!r} is in layer {match.group(2)}, but config.json "
                                      f"has {limit} layers")


# Completeness: what every checkpoint of a family holds (whatever its variant), as regexes. Outside the
# layers: the embeddings and final norms (the LM head is checked apart: absent when tied). In every
# layer: attention, MLP (or the MoE router) and norms. On top, a tensor most layers of a stack have
# (half or more) is required in all of them: biases, experts, T5's cross-attention.
_GLOBAL_REQUIRED = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2"), (r"embed_tokens\.weight$", r"(^|\.)norm\.weight$")),
    "gptj": (r"wte\.weight$", r"ln_f\.weight$"),
    "gpt_neox": (r"embed_in\.weight$", r"final_layer_norm\.weight$"),
    "opt": (r"embed_tokens\.weight$", r"embed_positions\.weight$"),
    "bloom": (r"word_embeddings\.weight$", r"word_embeddings_layernorm\.weight$", r"ln_f\.weight$"),
    "t5": (r"^(shared|encoder\.embed_tokens)\.weight$", r"^encoder\.final_layer_norm\.weight$",
           r"^decoder\.final_layer_norm\.weight$"),
}
_LM_HEAD = {"gpt_neox": r"^(embed_out|lm_head)\.weight$"}
_LAYER_REQUIRED = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2"), (
        r"self_attn\.q_proj\.weight", r"self_attn\.k_proj\.weight", r"self_attn\.v_proj\.weight",
        r"self_attn\.o_proj\.weight", r"(mlp\.down_proj|block_sparse_moe\.gate)\.weight",
        r"input_layernorm\.weight", r"post_attention_layernorm\.weight")),
    "gptj": (r"attn\.q_proj\.weight", r"attn\.k_proj\.weight", r"attn\.v_proj\.weight", r"attn\.out_proj\.weight",
             r"mlp\.fc_in\.weight", r"mlp\.fc_out\.weight", r"ln_1\.weight"),
    "gpt_neox": (r"attention\.query_key_value\.weight", r"attention\.dense\.weight", r"mlp\.dense_h_to_4h\.weight",
                 r"mlp\.dense_4h_to_h\.weight", r"input_layernorm\.weight", r"post_attention_layernorm\.weight"),
    "opt": (r"self_attn\.q_proj\.weight", r"self_attn\.k_proj\.weight", r"self_attn\.v_proj\.weight",
            r"self_attn\.out_proj\.weight", r"fc1\.weight", r"fc2\.weight", r"self_attn_layer_norm\.weight"),
    "bloom": (r"self_attention\.query_key_value\.weight", r"self_attention\.dense\.weight",
              r"mlp\.dense_h_to_4h\.weight", r"mlp\.dense_4h_to_h\.weight", r"input_layernorm\.weight",
              r"post_attention_layernorm\.weight"),
    "t5": (r"SelfAttention\.q\.weight", r"SelfAttention\.k\.weight", r"SelfAttention\.v\.weight",
           r"SelfAttention\.o\.weight", r"DenseReluDense\.wo\.weight"),
}
_FIRST_LAYER_ONLY = re.compile(r"relative_attention_bias")  # T5 keeps its position bias in block 0


def check_complete(path: Path, facts: ModelFacts, tensors: dict[str, TensorInfo]) -> None:
    """Every tensor config.json implies is there: otherwise the build would ship an artifact whose
    workers fail at container start. Names the first missing tensor."""
    def missing(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: the checkpoint has no tensor {what}, which config.json implies "
                               f"({facts.family}, {facts.layers} layers)")

    def shown(pattern: str) -> str:
        return pattern.replace("(^|\\.)", "").strip("^$").replace("\\", "")

    names = list(tensors)
    for pattern in _GLOBAL_REQUIRED.get(facts.family, ()):
        if not any(re.search(pattern, name) for name in names):
            raise missing(f"named *{shown(pattern)}")
    if not facts.tie_word_embeddings:
        head = _LM_HEAD.get(facts.family, r"^lm_head\.weight$")
        if not any(re.search(head, name) for name in names):
            raise missing(f"{shown(head)} (the LM head; tie_word_embeddings is false)")
    stacks: dict[str, dict[int, set[str]]] = {}
    for name in names:
        match = _STACK.match(name)
        if match:
            stacks.setdefault(match.group(1), {}).setdefault(int(match.group(2)), set()).add(match.group(3))
    if facts.layers and not stacks:
        raise missing("of any layer")
    for stack, layers in sorted(stacks.items()):
        count = _stack_layers(facts, stack)
        counts: dict[str, int] = {}
        for suffixes in layers.values():
            for suffix in suffixes:
                counts[suffix] = counts.get(suffix, 0) + 1
        # Families with a layout: what half the layers have, all must. Others may mix kinds of layers
        # (DeepSeek's dense first blocks before MoE ones, Llama 4's interleaved experts): a strict majority.
        quorum = (lambda n: 2 * n >= count) if facts.family in _LAYER_REQUIRED else (lambda n: 2 * n > count)
        common = {s for s, n in counts.items() if quorum(n) and not _FIRST_LAYER_ONLY.search(s)}
        for index in range(count):
            have = layers.get(index)
            if have is None:
                raise missing(f"in {stack}.{index} (layer {index} of {count} is absent)")
            for pattern in _LAYER_REQUIRED.get(facts.family, ()):
                if not any(re.search(pattern, suffix) for suffix in have):
                    raise missing(f"{stack}.{index}.*{shown(pattern)}")
            absent = sorted(common - have)
            if absent:
                raise missing(f"{stack}.{index}.{absent[0]} ({counts[absent[0]]} of {count} layers have it)")


_QUANTIZED_NAME = re.compile(r"(_scale|_scale_inv|\.qweight|\.qzeros|\.scales|\.g_idx|\.absmax|\.quant_map)$")
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


def _check_not_quantized(tensors: dict[str, TensorInfo]) -> None:
    """Weights lmc would cast or quantize must be plain floats: a pre-quantized checkpoint (FP8 with
    scales, GPTQ/AWQ, bitsandbytes) would be upcast without its scales, or collide with lmc's own."""
    for name, tensor in tensors.items():
        if _QUANTIZED_NAME.search(name) or (name.endswith("weight") and len(tensor.shape) == 2
                                             and tensor.dtype not in _FLOAT_DTYPES):
            raise CheckpointError(f"{tensor.file}: tensor {name!r} ({tensor.dtype}) looks pre-quantized; lmc builds "
                                  "from 16- or 32-bit float weights and quantizes them itself")
        # Any other weight (norms, 1-D) must be a float vector or more: a BOOL norm, or a scalar where a
        # vector belongs, would build and only fail in the serving container. (Buffers such as GPT-J's
        # boolean attn.bias mask are not weights.)
        if name.endswith(".weight") and (tensor.dtype not in _FLOAT_DTYPES or not tensor.shape):
            what = f"a {tensor.dtype} scalar" if not tensor.shape else f"{tensor.dtype}, not a float type"
            raise CheckpointError(f"{tensor.file}: tensor {name!r} is {what}; weights are float tensors")


def _tokenizer_files(path: Path) -> list[str]:
    for names in TOKENIZER_MODELS:
        if all((path / name).is_file() for name in names):
            break
    else:
        raise CheckpointError(f"{path}: no tokenizer files (expected tokenizer.json, tokenizer.model, spiece.model, "
                              "vocab.json + merges.txt, or vocab.txt)")
    found = {name for group in TOKENIZER_MODELS for name in group if (path / name).is_file()}
    found |= {name for name in _TOKENIZER_EXTRAS if (path / name).is_file()}
    return sorted(found)


def _convert_pickles(path: Path, pickles: list[Path]) -> list[Path]:
    """Load each pickle with weights_only=True (no code runs) and rewrite it as safetensors in a temp dir."""
    import torch

    out_dir = Path(tempfile.mkdtemp(prefix="lmc-unpickled-"))
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    index = path / PICKLE_INDEX_NAME
    if index.is_file():
        pickles = [path / name for name in sorted(set(_weight_map(index).values()))]
    converted = []
    for number, file in enumerate(pickles):
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {PICKLE_INDEX_NAME})")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is the file's fault
            reason = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).split())[:200]  # torch colours its hints
            raise CheckpointError(f"{file}: cannot load as a weights-only pickle: {reason}") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{file}: not a state dict of tensors")
        target = out_dir / f"converted-{number:05d}.safetensors"
        entries = [(name, dtype_code(t.dtype), tuple(t.shape)) for name, t in state.items()]
        with StreamingWriter(target, entries, {"format": "pt", "lmc.source": file.name}) as writer:
            for name, tensor in state.items():
                writer.write(name, tensor)
        del state
        converted.append(target)
    return converted
