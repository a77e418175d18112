"""The tiny checkpoint builder: loadable by transformers, reproducible to the byte, sized on demand."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from lmc.testing import FAMILIES, make_checkpoint  # noqa: E402
from lmc.testing.checkpoints import NEWER_FAMILIES, VOCAB_SIZE  # noqa: E402


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_and_generates(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, T5ForConditionalGeneration

    path = make_checkpoint(family, tmp_path / family)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in path.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) <= VOCAB_SIZE
    cls = T5ForConditionalGeneration if family == "t5" else AutoModelForCausalLM
    model = cls.from_pretrained(path)
    batch = tokenizer("Hello, wörld — 你好", return_tensors="pt")  # byte-level: anything encodes
    assert int(batch.input_ids.max()) < VOCAB_SIZE
    out = model.generate(**batch, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    # Three new tokens: after the prompt for decoder-only models, after the start token for T5.
    assert out.shape[1] == (4 if family == "t5" else batch.input_ids.shape[1] + 3)


def test_llama_tokenizer_has_a_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_checkpoint("llama", tmp_path))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nhi</s>\n<|assistant|>\n"


def test_mixtral_uses_hub_expert_names(tmp_path):
    from safetensors import safe_open

    path = make_checkpoint("mixtral", tmp_path)
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert not any("gate_up_proj" in name for name in names)


def test_same_seed_same_bytes_across_processes(tmp_path):
    script = ("import sys; from pathlib import Path; from lmc.testing import make_checkpoint;"
              "make_checkpoint('qwen2', Path(sys.argv[1]), seed=3, shards=2)")
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], check=True, capture_output=True,
                       cwd=Path(__file__).resolve().parents[1])
    first, second = _digests(tmp_path / "a"), _digests(tmp_path / "b")
    assert first == second
    assert "model.safetensors.index.json" in first


def test_different_seed_different_weights(tmp_path):
    a = make_checkpoint("gptj", tmp_path / "a", seed=0)
    b = make_checkpoint("gptj", tmp_path / "b", seed=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_shards_index_names_every_tensor(tmp_path):
    from safetensors import safe_open

    path = make_checkpoint("opt", tmp_path, shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for file in files:
        with safe_open(str(path / file), "pt") as handle:
            assert {n for n, f in index["weight_map"].items() if f == file} == set(handle.keys())


def test_config_is_sorted_and_tp_unfriendly_breaks_divisibility(tmp_path):
    path = make_checkpoint("llama", tmp_path, tp_friendly=False, dtype="float16")
    text = (path / "config.json").read_text()
    config = json.loads(text)
    assert list(config) == sorted(config)
    assert config["num_attention_heads"] % 2 == 1
    assert config["dtype"] == "float16"


def test_size_bytes_adds_layers_not_width(tmp_path):
    from safetensors import safe_open

    def largest_and_total(path):
        with safe_open(str(path / "model.safetensors"), "pt") as handle:
            shapes = [handle.get_slice(n).get_shape() for n in handle.keys()]
        sizes = [4 * int(torch.tensor(s).prod()) for s in shapes]
        return max(sizes), sum(sizes)

    small = make_checkpoint("llama", tmp_path / "s", size_bytes=2_000_000)
    big = make_checkpoint("llama", tmp_path / "b", size_bytes=8_000_000)
    (small_max, small_total), (big_max, big_total) = largest_and_total(small), largest_and_total(big)
    assert small_max == big_max
    assert abs(small_total - 2_000_000) < 0.1 * 2_000_000
    assert abs(big_total - 8_000_000) < 0.1 * 8_000_000
    assert json.loads((big / "config.json").read_text())["num_hidden_layers"] > 2


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        make_checkpoint("gpt2", tmp_path)


# ------------------------------------------------------------------ the newer architectures

@pytest.mark.parametrize("family", NEWER_FAMILIES)
def test_newer_family_is_reproducible_and_loads_with_every_key(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = make_checkpoint(family, tmp_path / "a", seed=5)
    second = make_checkpoint(family, tmp_path / "b", seed=5)
    assert _digests(first) == _digests(second)
    config = json.loads((first / "config.json").read_text())
    assert config["model_type"] == family
    # heads of 32 (DeepSeek's head_dim: its rope part, 64): vLLM's CPU attention has no smaller kernel
    assert (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]) == (
        64 if family == "deepseek_v3" else 32)
    model, info = AutoModelForCausalLM.from_pretrained(first, output_loading_info=True)
    assert {key: sorted(value) for key, value in info.items() if value} == {}
    batch = AutoTokenizer.from_pretrained(first)("the quick brown fox", return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert out.shape[1] == batch.input_ids.shape[1] + 2


def test_newer_families_keep_their_tie_default_and_draw_biases(tmp_path):
    from safetensors import safe_open

    gemma = make_checkpoint("gemma3_text", tmp_path / "gemma")
    assert json.loads((gemma / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(gemma / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" not in set(handle.keys())
    gpt_oss = make_checkpoint("gpt_oss", tmp_path / "gpt_oss")
    with safe_open(str(gpt_oss / "model.safetensors"), "pt") as handle:
        assert handle.get_tensor("model.layers.0.mlp.experts.down_proj_bias").abs().sum() > 0


def test_sliding_window_families_mix_layer_types_at_any_size(tmp_path):
    for family in ("gemma3_text", "gpt_oss"):
        config = json.loads((make_checkpoint(family, tmp_path / family) / "config.json").read_text())
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
        assert config["sliding_window"] == 16
    big = make_checkpoint("gemma3_text", tmp_path / "big", size_bytes=3_000_000)
    config = json.loads((big / "config.json").read_text())
    assert config["num_hidden_layers"] > 2
    assert len(config["layer_types"]) == config["num_hidden_layers"]
    assert config["layer_types"][:4] == ["sliding_attention", "full_attention"] * 2


def test_moe_families_use_hub_names(tmp_path):
    from safetensors import safe_open

    def names(path):
        with safe_open(str(path / "model.safetensors"), "pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}

    qwen = make_checkpoint("qwen3_moe", tmp_path / "qwen")
    config = json.loads((qwen / "config.json").read_text())
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 2) and "num_local_experts" not in config
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names(qwen)
    # gpt-oss: the experts fused, [experts, hidden, 2 x expert width] and [experts, width, hidden]
    gpt_oss = names(make_checkpoint("gpt_oss", tmp_path / "gpt_oss"))
    assert gpt_oss["model.layers.0.mlp.experts.gate_up_proj"] == (4, 128, 128)
    assert gpt_oss["model.layers.0.mlp.experts.down_proj"] == (4, 64, 128)
    assert "model.layers.0.self_attn.sinks" in gpt_oss
    deepseek = names(make_checkpoint("deepseek_v3", tmp_path / "deepseek"))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in deepseek
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in deepseek
    assert not any(name.startswith("model.layers.0.mlp.experts") for name in deepseek)  # first layer dense
