"""Tiny random Hugging Face checkpoints, built locally and byte-for-byte reproducible.

`make_checkpoint("llama", tmp_path)` writes what a hub checkpoint directory holds — config.json,
generation_config.json, model.safetensors (or shards plus an index), tokenizer.json,
tokenizer_config.json, special_tokens_map.json — for a 2-layer model about 64 wide. The same
seed gives the same bytes on any machine with the same pinned torch/transformers/tokenizers:
the weights come from `torch.manual_seed(seed)`, the tokenizer from a byte-level BPE trained on
the fixed text below, and every JSON file is written with sorted keys.

Tensor names are the hub's: the model is saved once with `save_pretrained` (which drops tied
weights and undoes transformers' internal conversions, e.g. Mixtral's fused experts back to
`block_sparse_moe.experts.N.w1`), then rewritten here with sorted names and fixed metadata.
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "gptj", "gpt_neox", "opt", "bloom", "t5")

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
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_TORCH_DTYPES)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config(family, tp_friendly, config_overrides)
    if size_bytes is not None:
        _set_layers_for_size(family, config, size_bytes, dtype)
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
        probe = config.__class__(**dict(config.to_dict(), **{layers_key: layers}, **_t5_decoder(family, layers)))
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
    model = _instantiate(family, config).to(getattr(torch, dtype)).eval()
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
    generation_json.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if family == "t5":
        generation_json["decoder_start_token_id"] = PAD_ID
    return tensors, config_json, generation_json


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
def _tokenizer_json() -> str:
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
    (out_dir / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
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
    parser.add_argument("family", choices=FAMILIES)
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
