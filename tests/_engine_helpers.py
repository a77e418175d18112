"""Tiny random checkpoints and pre-partitioned artifacts for the engine tests (no hub, seconds to build)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "large models are served by tensor parallel ranks",
    "héllo wörld — ünïcode text, emojis 🙂 and numbers 12345",
    "a compiler plans memory, latency and cost before deployment",
] * 20

HIDDEN, HEADS, LAYERS = 64, 4, 2


def make_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)


def make_config(family: str, vocab_size: int, **overrides):
    import transformers as tf

    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family in ("llama", "mistral", "qwen2"):
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[family]
        config = cls(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                     initializer_range=0.2, **common)
    elif family == "gpt_neox":
        config = tf.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, max_position_embeddings=256, tie_word_embeddings=False,
                                  initializer_range=0.2, **common)
    elif family == "opt":
        config = tf.OPTConfig(hidden_size=HIDDEN, ffn_dim=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                              max_position_embeddings=256, word_embed_proj_dim=HIDDEN, init_std=0.2, **common)
    elif family == "gptj":
        config = tf.GPTJConfig(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=256, rotary_dim=8,
                               tie_word_embeddings=False, initializer_range=0.2, **common)
    elif family == "bloom":
        config = tf.BloomConfig(hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, initializer_range=0.2, **common)
    elif family == "t5":
        config = tf.T5Config(d_model=HIDDEN, d_kv=16, d_ff=128, num_layers=LAYERS, num_heads=HEADS,
                             decoder_start_token_id=0, initializer_factor=4.0, **common)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def make_checkpoint(family: str, out_dir: Path, *, seed: int = 0, vocab_size: int = 384, **overrides) -> Path:
    import transformers as tf

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = make_config(family, vocab_size, **overrides)
    cls = tf.AutoModelForSeq2SeqLM if family == "t5" else tf.AutoModelForCausalLM
    model = cls.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    make_tokenizer(out_dir)
    return out_dir


def build_artifact(checkpoint: Path, out_dir: Path, family: str, tp: int, *, int8: bool = False) -> Path:
    """config + tokenizer + shards/tp{tp}/rank{r}.safetensors sliced as lmc.layouts describes."""
    from safetensors.torch import load_file, save_file

    from lmc.layouts import rank_split, shard_path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out_dir / item.name)
    config = json.loads((checkpoint / "config.json").read_text())
    heads = config.get("num_attention_heads") or config.get("n_head") or config.get("num_heads")
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    tensors = load_file(checkpoint / "model.safetensors")
    for rank in range(tp):
        shard = {}
        for name, tensor in sorted(tensors.items()):
            split = rank_split(family, name, tuple(tensor.shape), rank, tp, head_dim=head_dim, kv_heads=kv_heads)
            part = tensor if split.dim is None else tensor.narrow(split.dim, split.start, split.stop - split.start)
            if int8 and part.dim() == 2 and _is_linear(name):
                scale = part.abs().amax(dim=1).clamp(min=1e-8) / 127.0
                shard[name] = torch.round(part / scale[:, None]).to(torch.int8).contiguous()
                shard[name + "_scale"] = scale.contiguous()
            else:
                shard[name] = part.contiguous()
        path = out_dir / shard_path(tp, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(shard, path)
    return out_dir


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and not any(k in name for k in ("embed", "wte", "wpe", "norm", "ln", "shared",
                                                                    "relative_attention_bias"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hf_greedy(checkpoint: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """Reference: HF generate on the unpartitioned checkpoint, greedy, generated ids without EOS/padding."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    config = tf.AutoConfig.from_pretrained(checkpoint)
    cls = tf.AutoModelForSeq2SeqLM if config.is_encoder_decoder else tf.AutoModelForCausalLM
    model = cls.from_pretrained(checkpoint, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    ids = out[0].tolist() if config.is_encoder_decoder else out[0, inputs["input_ids"].shape[1]:].tolist()
    if config.is_encoder_decoder:
        ids = ids[1:]  # the decoder start token
    result = []
    for token in ids:
        if token == config.eos_token_id:
            break
        result.append(token)
    return result


def build_artifact_with_partitioner(checkpoint: Path, out_dir: Path, tp: int, dtype: str) -> Path:
    """The same artifact layout, written by the build's own partitioner (lmc.emitters.partition)."""
    from lmc.emitters.checkpoint import validate_checkpoint
    from lmc.emitters.partition import partition_checkpoint
    from lmc.planner.checkpoint_facts import checkpoint_model_facts

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, out_dir / item.name)
    facts = checkpoint_model_facts(checkpoint, "test/model")
    info = validate_checkpoint(checkpoint, facts)
    partition_checkpoint(info, family=facts.family, dtype=dtype, tp=tp, head_dim=facts.head_dim,
                         kv_heads=facts.kv_heads, out_dir=out_dir, progress=False)
    return out_dir
