"""Model facts from a local checkpoint: config.json plus safetensors headers, with one-line errors."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from lmc.errors import CheckpointError
from lmc.planner.architecture import estimate_parameters
from lmc.planner.checkpoint_facts import checkpoint_model_facts, read_safetensors_header

_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128,
    "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "float32",
}
TINY_T5 = {
    "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 32, "d_kv": 8, "num_heads": 4,
    "d_ff": 48, "num_layers": 2, "num_decoder_layers": 3, "vocab_size": 100, "is_encoder_decoder": True,
    "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A valid safetensors file of zeros: the header format written by hand, no numpy or torch."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * _ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def llama_tensors(config: dict, dtype: str = "BF16") -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensor names and shapes transformers' LlamaForCausalLM saves, for `config`."""
    h, inner, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    tensors = {"model.embed_tokens.weight": (dtype, (v, h)), "model.norm.weight": (dtype, (h,)),
               "lm_head.weight": (dtype, (v, h))}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": (dtype, (h, h)), prefix + "self_attn.k_proj.weight": (dtype, (kv, h)),
            prefix + "self_attn.v_proj.weight": (dtype, (kv, h)), prefix + "self_attn.o_proj.weight": (dtype, (h, h)),
            prefix + "mlp.gate_proj.weight": (dtype, (inner, h)), prefix + "mlp.up_proj.weight": (dtype, (inner, h)),
            prefix + "mlp.down_proj.weight": (dtype, (h, inner)),
            prefix + "input_layernorm.weight": (dtype, (h,)), prefix + "post_attention_layernorm.weight": (dtype, (h,)),
        }
    return tensors


def make_checkpoint(directory: Path, config: dict, tensors: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        write_safetensors(directory / "model.safetensors", tensors)
    return directory


def expected_count(tensors: dict) -> int:
    return sum(math.prod(shape) for _, shape in tensors.values())


def test_tiny_llama_with_gqa(tmp_path):
    tensors = llama_tensors(TINY_LLAMA)
    facts = checkpoint_model_facts(make_checkpoint(tmp_path / "llama", TINY_LLAMA, tensors), "acme/tiny-llama")
    assert facts.parameters == expected_count(tensors) == 78144
    assert (facts.id, facts.family, facts.architecture) == ("acme/tiny-llama", "llama", "LlamaForCausalLM")
    assert (facts.attention_heads, facts.kv_heads, facts.head_dim) == (4, 2, 16)
    assert (facts.layers, facts.intermediate_size, facts.max_position_embeddings) == (2, 96, 256)
    assert facts.torch_dtype == "bf16"  # the headers win over config.json's float32
    assert facts.source == str(tmp_path / "llama")
    assert estimate_parameters(facts) == facts.parameters


def test_sharded_checkpoint_sums_every_shard(tmp_path):
    tensors = llama_tensors(TINY_LLAMA, dtype="F16")
    names = sorted(tensors)
    first, second = dict((n, tensors[n]) for n in names[:10]), dict((n, tensors[n]) for n in names[10:])
    directory = make_checkpoint(tmp_path / "sharded", TINY_LLAMA)
    write_safetensors(directory / "model-00001-of-00002.safetensors", first)
    write_safetensors(directory / "model-00002-of-00002.safetensors", second)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first} | {n: "model-00002-of-00002.safetensors" for n in second}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    facts = checkpoint_model_facts(directory, "acme/sharded")
    assert facts.parameters == expected_count(tensors)
    assert facts.torch_dtype == "fp16"


def test_shard_named_by_the_index_but_missing(tmp_path):
    directory = make_checkpoint(tmp_path / "c", TINY_LLAMA)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(directory, "x")
    assert str(caught.value) == f"{directory / 'model-1.safetensors'}: missing (listed in model.safetensors.index.json)"


def t5_tensors(config: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    d, inner, heads, v = config["d_model"], config["d_ff"], config["num_heads"], config["vocab_size"]
    width = heads * config["d_kv"]
    tensors = {"shared.weight": ("F32", (v, d)), "lm_head.weight": ("F32", (v, d)),
               "encoder.final_layer_norm.weight": ("F32", (d,)), "decoder.final_layer_norm.weight": ("F32", (d,))}

    def attention(prefix):
        return {prefix + p: ("F32", shape) for p, shape in
                [("q.weight", (width, d)), ("k.weight", (width, d)), ("v.weight", (width, d)), ("o.weight", (d, width))]}

    def ffn(prefix):
        return {prefix + "wi_0.weight": ("F32", (inner, d)), prefix + "wi_1.weight": ("F32", (inner, d)),
                prefix + "wo.weight": ("F32", (d, inner))}

    for i in range(config["num_layers"]):
        p = f"encoder.block.{i}.layer."
        tensors |= attention(p + "0.SelfAttention.") | ffn(p + "1.DenseReluDense.")
        tensors |= {p + "0.layer_norm.weight": ("F32", (d,)), p + "1.layer_norm.weight": ("F32", (d,))}
    for i in range(config["num_decoder_layers"]):
        p = f"decoder.block.{i}.layer."
        tensors |= attention(p + "0.SelfAttention.") | attention(p + "1.EncDecAttention.") | ffn(p + "2.DenseReluDense.")
        tensors |= {p + f"{j}.layer_norm.weight": ("F32", (d,)) for j in range(3)}
    for stack in ("encoder", "decoder"):
        tensors[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = ("F32", (32, heads))
    return tensors


def test_tiny_t5_encoder_decoder(tmp_path):
    tensors = t5_tensors(TINY_T5)
    facts = checkpoint_model_facts(make_checkpoint(tmp_path / "t5", TINY_T5, tensors), "acme/tiny-t5")
    assert facts.parameters == expected_count(tensors)
    assert facts.family == "t5" and facts.is_encoder_decoder
    assert (facts.encoder_layers, facts.layers, facts.hidden_size, facts.head_dim, facts.intermediate_size) == (2, 3, 32, 8, 48)
    assert facts.max_position_embeddings is None and facts.torch_dtype == "fp32"
    assert estimate_parameters(facts, gated_ffn=True) == facts.parameters


@pytest.mark.parametrize(("config", "expected"), [
    ({"model_type": "gptj", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 128, "n_positions": 64},
     {"intermediate_size": 256, "head_dim": 16, "max_position_embeddings": 64, "tie_word_embeddings": False}),
    ({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "intermediate_size": 256, "vocab_size": 128, "max_position_embeddings": 64}, {"intermediate_size": 256}),
    ({"model_type": "opt", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "ffn_dim": 200,
      "vocab_size": 128, "max_position_embeddings": 64, "word_embed_proj_dim": 64},
     {"intermediate_size": 200, "tie_word_embeddings": True}),
    ({"model_type": "bloom", "hidden_size": 64, "n_head": 4, "n_layer": 3, "vocab_size": 128},
     {"intermediate_size": 256, "layers": 3, "max_position_embeddings": None}),
    ({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
      "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 128, "num_local_experts": 4,
      "num_experts_per_tok": 2}, {"num_experts": 4, "experts_per_token": 2, "kv_heads": 1}),
    ({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "intermediate_size": 96, "vocab_size": 128, "head_dim": 32}, {"kv_heads": 4, "head_dim": 32}),
    ({"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "intermediate_size": 96, "vocab_size": 128}, {"family": "mistral"}),
])
def test_family_config_mapping(tmp_path, config, expected):
    directory = make_checkpoint(tmp_path / "c", config, {"w": ("F16", (3, 5))})
    facts = checkpoint_model_facts(directory, "acme/m")
    for key, value in expected.items():
        assert getattr(facts, key) == value, key
    assert facts.parameters == 15  # counted from the header, whatever the config says


def test_counts_match_real_transformers_models(tmp_path):
    """The formula and the header count agree with transformers' own implementations, for every family."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    small = {
        "llama": dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64),
        "mixtral": dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64, num_local_experts=3, num_experts_per_tok=2),
        "qwen2": dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64, tie_word_embeddings=False),
        "gptj": dict(n_embd=32, n_head=4, n_layer=1, vocab_size=64, n_positions=32, rotary_dim=4, bos_token_id=0, eos_token_id=0),
        "gpt_neox": dict(hidden_size=32, intermediate_size=128, num_attention_heads=4, num_hidden_layers=1, vocab_size=64, max_position_embeddings=32),
        "opt": dict(hidden_size=32, ffn_dim=128, num_attention_heads=4, num_hidden_layers=1, vocab_size=64, max_position_embeddings=32, word_embed_proj_dim=32),
        "bloom": dict(hidden_size=32, n_head=4, n_layer=1, vocab_size=64),
        "t5": dict(d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=1, num_decoder_layers=2, vocab_size=64, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    }
    for model_type, kwargs in small.items():
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        auto = transformers.AutoModelForSeq2SeqLM if model_type == "t5" else transformers.AutoModelForCausalLM
        model = auto.from_config(config)
        directory = tmp_path / model_type
        model.save_pretrained(directory)
        facts = checkpoint_model_facts(directory, model_type)
        actual = sum(p.numel() for p in model.parameters())
        assert facts.parameters == actual, model_type
        assert estimate_parameters(facts, gated_ffn=True) == actual, model_type


# --- errors: one line, naming the file ----------------------------------------------------------

def assert_one_line(error: CheckpointError, *fragments: str) -> None:
    message = str(error)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path / "nowhere", "x")
    assert str(caught.value) == f"{tmp_path / 'nowhere'}: no such checkpoint directory"


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    assert str(caught.value) == f"{tmp_path / 'config.json'}: missing (a HF checkpoint directory needs its config.json)"


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    assert_one_line(caught.value, str(tmp_path / "config.json"), "not valid JSON")


def test_any_model_type_is_read_from_its_config(tmp_path):
    # No family list: an architecture lmc has never heard of is planned from its config's keys, and a
    # config that lacks one says which, in one line.
    make_checkpoint(tmp_path / "bare", {"model_type": "falcon", "architectures": ["FalconForCausalLM"]})
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path / "bare", "x")
    assert str(caught.value) == f"{tmp_path / 'bare' / 'config.json'}: missing `hidden_size` (needed for a falcon model)"
    config = dict(TINY_LLAMA, model_type="newarch", architectures=["NewArchForCausalLM"])
    facts = checkpoint_model_facts(make_checkpoint(tmp_path / "new", config, llama_tensors(TINY_LLAMA)), "x")
    assert (facts.family, facts.architecture, facts.parameters) == ("newarch", "NewArchForCausalLM", 78144)


def test_model_type_that_is_not_one(tmp_path):
    make_checkpoint(tmp_path, {"model_type": "Not A Type!"})
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    assert_one_line(caught.value, str(tmp_path / "config.json"), "model_type 'Not A Type!' is not a Hugging Face model type")


@pytest.mark.parametrize("architectures", [-1, 0.5, True, {"a": 1}, [1]])
def test_architectures_that_are_not_a_list_of_class_names(tmp_path, architectures):
    # Each crashed the plan (exit 70: indexing an int, KeyError 0 on a dict); found by fuzzing config.json.
    make_checkpoint(tmp_path, dict(TINY_LLAMA, architectures=architectures), llama_tensors(TINY_LLAMA))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    assert_one_line(caught.value, str(tmp_path / "config.json"), "architectures must list class names")


def test_config_missing_a_dimension(tmp_path):
    config = {key: value for key, value in TINY_LLAMA.items() if key != "intermediate_size"}
    make_checkpoint(tmp_path, config, {"w": ("F32", (2,))})
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    assert str(caught.value) == f"{tmp_path / 'config.json'}: missing `intermediate_size` (needed for a llama model)"


def test_no_weights_at_all(tmp_path):
    make_checkpoint(tmp_path, TINY_LLAMA)
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    assert_one_line(caught.value, str(tmp_path), "no *.safetensors", "--allow-pickle")


def test_pickle_only_checkpoint_is_estimated_and_says_so(tmp_path):
    make_checkpoint(tmp_path, TINY_LLAMA)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    facts = checkpoint_model_facts(tmp_path, "x")
    assert facts.parameters == expected_count(llama_tensors(TINY_LLAMA))
    assert "estimated" in facts.source and "--allow-pickle" in facts.source


def test_truncated_header(tmp_path):
    make_checkpoint(tmp_path, TINY_LLAMA)
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 500) + b'{"w": {')
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    assert_one_line(caught.value, f"{file}: corrupt safetensors file: header of 500 bytes does not fit in the 15-byte file")


def test_file_shorter_than_the_length_prefix(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError) as caught:
        read_safetensors_header(file)
    assert_one_line(caught.value, f"{file}: corrupt safetensors file: 2 bytes, too short for a header")


def test_header_not_json(tmp_path):
    make_checkpoint(tmp_path, TINY_LLAMA)
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 6) + b"\xff\xfeabc" + bytes(8))
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    assert_one_line(caught.value, f"{file}: corrupt safetensors file: header is not valid JSON (")


def test_offsets_past_the_end(tmp_path):
    make_checkpoint(tmp_path, TINY_LLAMA)
    file = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))  # 64 bytes promised, 16 present
    with pytest.raises(CheckpointError) as caught:
        checkpoint_model_facts(tmp_path, "x")
    data_start = 8 + len(header)
    assert_one_line(caught.value, f"{file}: corrupt safetensors file: tensor 'w' ends at byte {data_start + 64}, "
                    f"past the end of the {data_start + 16}-byte file")


def test_offsets_disagreeing_with_the_shape(tmp_path):
    file = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    with pytest.raises(CheckpointError) as caught:
        read_safetensors_header(file)
    assert_one_line(caught.value, f"{file}: corrupt safetensors file: tensor 'w' spans 32 bytes; F32 x [4, 4] needs 64")


def test_header_is_read_without_reading_tensor_data(tmp_path):
    # A sparse file: a 64 GiB tensor that occupies no disk. Reading its data would take minutes.
    file = tmp_path / "model.safetensors"
    size = 2**36
    header = json.dumps({"big": {"dtype": "F32", "shape": [2**34], "data_offsets": [0, size]}}).encode()
    with file.open("wb") as stream:
        stream.write(struct.pack("<Q", len(header)) + header)
        stream.truncate(8 + len(header) + size)
    assert read_safetensors_header(file) == [("big", "F32", (2**34,))]


def test_an_index_whose_weight_map_is_not_names_is_one_line(tmp_path):
    import json

    from lmc.errors import CheckpointError
    from lmc.planner.checkpoint_facts import safetensors_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": 1}}))
    with pytest.raises(CheckpointError) as excinfo:
        safetensors_files(tmp_path)
    assert "not a safetensors index (needs a `weight_map` object)" in str(excinfo.value)


def test_a_partial_sharded_download_without_an_index_is_refused(tmp_path):
    from lmc.errors import CheckpointError
    from lmc.planner.checkpoint_facts import safetensors_files
    from lmc.testing import make_checkpoint

    path = make_checkpoint("qwen2", tmp_path / "q", shards=2)
    (path / "model.safetensors.index.json").unlink()
    assert len(safetensors_files(path)) == 2
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as excinfo:
        safetensors_files(path)
    assert str(excinfo.value) == (f"{path / 'model-00002-of-00002.safetensors'}: missing "
                                  "(model-00001-of-00002.safetensors says the checkpoint has 2 shards)")
