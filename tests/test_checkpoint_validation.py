"""validate_checkpoint: a good checkpoint passes; each kind of damage is one line naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from lmc.emitters.checkpoint import PICKLE_REFUSAL, validate_checkpoint  # noqa: E402
from lmc.emitters.safetensors_stream import read_header  # noqa: E402
from lmc.errors import CheckpointError  # noqa: E402
from lmc.planner.checkpoint_facts import checkpoint_model_facts  # noqa: E402
from lmc.testing import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(pristine, tmp_path / "llama"))


def _facts(path: Path):
    return checkpoint_model_facts(path, "tiny/llama")


def _error(path: Path, facts=None, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(path, facts or _facts(path), **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_good_checkpoint_lists_tensors_and_files(ckpt):
    info = validate_checkpoint(ckpt, _facts(ckpt))
    assert info.files == (ckpt / "model.safetensors",)
    file, dtype, shape, (begin, end) = info.tensors["model.layers.0.self_attn.k_proj.weight"]
    assert (file, dtype, shape) == (ckpt / "model.safetensors", "F32", (32, 64))  # 2 kv heads x 16
    assert end - begin == 32 * 64 * 4
    assert info.tokenizer_files == ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
    assert "generation_config.json" in info.extra_files
    assert info.largest_tensor_bytes == 384 * 64 * 4


def test_sharded_checkpoint_and_missing_shard(tmp_path):
    path = make_checkpoint("qwen2", tmp_path / "q", shards=2)
    facts = checkpoint_model_facts(path, "q")
    assert len(validate_checkpoint(path, facts).files) == 2
    (path / "model-00002-of-00002.safetensors").unlink()
    message = _error(path, facts)
    assert message.startswith(f"{path / 'model-00002-of-00002.safetensors'}: missing (listed in model.safetensors.index.json)")


def test_missing_directory(tmp_path):
    facts_dir = make_checkpoint("llama", tmp_path / "real")
    assert _error(tmp_path / "nope", _facts(facts_dir)) == f"{tmp_path / 'nope'}: no such checkpoint directory"


def test_missing_config(ckpt):
    facts = _facts(ckpt)
    (ckpt / "config.json").unlink()
    assert _error(ckpt, facts).startswith(f"{ckpt / 'config.json'}: missing")


def test_truncated_safetensors(ckpt):
    facts = _facts(ckpt)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    message = _error(ckpt, facts)
    assert message.startswith(f"{weights}: corrupt safetensors file: tensor ")
    assert "past the end of the" in message


def test_file_cut_inside_header(ckpt):
    facts = _facts(ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    assert "does not fit in the 50-byte file" in _error(ckpt, facts)


def test_header_offsets_past_end(ckpt):
    facts = _facts(ckpt)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    name = "model.norm.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 10**9, end + 10**9]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    message = _error(ckpt, facts)
    assert message.startswith(f"{weights}: corrupt safetensors file: tensor 'model.norm.weight' ends at byte")


def test_unknown_dtype_in_header(ckpt):
    facts = _facts(ckpt)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data.replace(b'"dtype":"F32"', b'"dtype":"F33"', 1))
    assert "has unknown dtype 'F33'" in _error(ckpt, facts)


def test_shape_disagrees_with_config(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the weights have 2 kv heads
    (ckpt / "config.json").write_text(json.dumps(config))
    message = _error(ckpt)
    assert message == (f"{ckpt / 'model.safetensors'}: tensor 'model.layers.0.self_attn.k_proj.weight' has shape "
                       "[32, 64], but config.json implies [64, 64] (kv_heads·head_dim × hidden_size)")


def test_vocab_disagrees_with_config(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["vocab_size"] = 400
    (ckpt / "config.json").write_text(json.dumps(config))
    message = _error(ckpt)
    assert "has shape [384, 64], but config.json implies [400, 64] (vocab_size × hidden_size)" in message


def test_more_layers_than_config(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(config))
    assert "is in layer 1, but config.json has 1 layers" in _error(ckpt)


@pytest.mark.parametrize("family", ["gptj", "gpt_neox", "opt", "bloom", "t5", "mixtral"])
def test_other_families_validate(family, tmp_path):
    path = make_checkpoint(family, tmp_path / family)
    info = validate_checkpoint(path, checkpoint_model_facts(path, family))
    assert info.family == family and len(info.tensors) > 10


def test_t5_feed_forward_mismatch(tmp_path):
    path = make_checkpoint("t5", tmp_path / "t5")
    config = json.loads((path / "config.json").read_text())
    config["d_ff"] = 256
    (path / "config.json").write_text(json.dumps(config))
    assert "(intermediate_size × hidden_size)" in _error(path)


def _pickle_only(ckpt: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(ckpt / "model.safetensors"))
    torch.save(state, ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()


def test_pickle_only_is_refused(ckpt):
    facts = _facts(ckpt)
    _pickle_only(ckpt)
    assert _error(ckpt, facts) == (f"{ckpt / 'pytorch_model.bin'}: the checkpoint has only pickle weights; "
                                   f"{PICKLE_REFUSAL}")
    assert PICKLE_REFUSAL == "pass --allow-pickle to load pickle checkpoints (they can run arbitrary code)"


def test_pickle_with_allow_pickle_is_converted(ckpt):
    from safetensors.torch import load_file

    facts = _facts(ckpt)
    original = load_file(str(ckpt / "model.safetensors"))
    _pickle_only(ckpt)
    info = validate_checkpoint(ckpt, facts, allow_pickle=True)
    assert info.from_pickle
    converted = {}
    for file in info.files:
        assert file.suffix == ".safetensors" and file.parent != ckpt
        converted.update(load_file(str(file)))
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], original[name]) for name in original)


def test_missing_tokenizer(ckpt):
    facts = _facts(ckpt)
    (ckpt / "tokenizer.json").unlink()
    message = _error(ckpt, facts)
    assert message.startswith(f"{ckpt}: no tokenizer files (expected tokenizer.json, tokenizer.model")


@pytest.mark.parametrize("name, text, expected", [
    ("tokenizer_config.json", "{bad", "tokenizer_config.json: not valid JSON (Expecting property name"),
    ("generation_config.json", "[1, 2]", "generation_config.json: expected a JSON object, got list"),
    ("special_tokens_map.json", "[" * 100_000 + "]" * 100_000, "special_tokens_map.json: not valid JSON (nested too deeply)"),
    ("tokenizer.json", "{bad", "tokenizer.json: not valid JSON"),
    ("tokenizer.json", '{"model": 5}', "tokenizer.json: the tokenizers library cannot load it ("),
], ids=["tokenizer_config", "generation_config", "deep", "tokenizer_not_json", "tokenizer_bad_model"])
def test_a_file_the_runtime_reads_that_it_could_not_is_refused_at_build(ckpt, name, text, expected):
    """The artifact carries these files for the runtime (its text tools, sampling defaults, the workers'
    tokenizer): broken, it would restart its workers forever. The build names the file instead."""
    facts = _facts(ckpt)
    (ckpt / name).write_text(text)
    assert expected in _error(ckpt, facts)


def test_a_config_json_nested_too_deeply_is_one_line(ckpt):
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="config.json: not valid JSON \\(nested too deeply\\)$"):
        _facts(ckpt)


def test_sentencepiece_tokenizer_is_enough(ckpt):
    facts = _facts(ckpt)
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.model").write_bytes(b"\x00")
    assert "tokenizer.model" in validate_checkpoint(ckpt, facts).tokenizer_files


def test_read_header_rejects_gaps(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}
    text = json.dumps(header).encode()
    path = tmp_path / "gap.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"gap\.safetensors: corrupt safetensors file: 4 unused bytes before tensor 'b'"):
        read_header(path)


def _rewrite(ckpt: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("dropped, expected", [
    (["lm_head.weight"], "no tensor lm_head.weight (the LM head; tie_word_embeddings is false)"),
    (["model.layers.1."], "no tensor in model.layers.1 (layer 1 of 2 is absent)"),
    (["model.layers.0.self_attn.q_proj.weight"], "no tensor model.layers.0.*self_attn.q_proj.weight"),
    (["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"],
     "no tensor model.layers.0.*self_attn.q_proj.weight"),  # gone from every layer: the family table knows
    (["model.norm.weight"], "no tensor named *norm.weight"),
])
def test_a_missing_tensor_is_named(ckpt, dropped, expected):
    facts = _facts(ckpt)
    _rewrite(ckpt, lambda t: [t.pop(n) for n in list(t) if any(n.startswith(d) for d in dropped)])
    message = _error(ckpt, facts)
    assert message.startswith(f"{ckpt}: the checkpoint has ") and expected in message
    assert message.endswith("which config.json implies (llama, 2 layers)")


def test_a_tensor_most_layers_have_is_required_in_every_layer(tmp_path):
    path = make_checkpoint("qwen2", tmp_path / "q")
    facts = checkpoint_model_facts(path, "q")
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.q_proj.bias"))
    assert "no tensor model.layers.1.self_attn.q_proj.bias (1 of 2 layers have it)" in _error(path, facts)


def test_tied_heads_and_t5_position_bias_in_block_0_only_are_complete(tmp_path):
    for family in ("opt", "bloom", "t5"):  # tied LM heads; T5 keeps relative_attention_bias in block 0
        path = make_checkpoint(family, tmp_path / family)
        info = validate_checkpoint(path, checkpoint_model_facts(path, family))
        assert "lm_head.weight" not in info.tensors  # tied: nothing to find, and nothing demanded
        biases = [n for n in info.tensors if "relative_attention_bias" in n]
        if family == "t5":
            assert biases and all(".block.0." in n for n in biases)


def test_pre_quantized_checkpoints_are_refused(ckpt):
    facts = _facts(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    assert "already quantized (quantization_config, method fp8)" in _error(ckpt, facts)
    (ckpt / "config.json").write_text(json.dumps(config))

    def to_fp8(t):
        name = "model.layers.0.mlp.up_proj.weight"
        t[name] = t[name].to(torch.float8_e4m3fn)
        t[name + "_scale"] = torch.ones(t[name].shape[0])
    _rewrite(ckpt, to_fp8)
    assert "tensor 'model.layers.0.mlp.up_proj.weight' (F8_E4M3) looks pre-quantized" in _error(ckpt, facts)


def test_only_hf_pickle_names_count_as_weights(ckpt):
    facts = _facts(ckpt)
    torch.save({"learning_rate": torch.tensor(1e-4)}, ckpt / "training_args.bin")
    assert validate_checkpoint(ckpt, facts, allow_pickle=True).from_pickle is False  # safetensors win anyway
    (ckpt / "model.safetensors").unlink()
    assert "no weights: expected *.safetensors" in _error(ckpt, facts, allow_pickle=True)


def test_a_pickle_index_that_is_not_a_weight_map_is_one_line(ckpt):
    facts = _facts(ckpt)
    _pickle_only(ckpt)
    (ckpt / "pytorch_model.bin.index.json").write_text("[1]")
    assert "not a weights index: needs a `weight_map` object" in _error(ckpt, facts, allow_pickle=True)


@pytest.mark.parametrize("change, expected", [
    (lambda t: t["model.norm.weight"].bool(), "tensor 'model.norm.weight' is BOOL, not a float type"),
    (lambda t: t["model.norm.weight"][0].clone(), "tensor 'model.norm.weight' is a F32 scalar"),
], ids=["bool_norm", "scalar_norm"])
def test_a_weight_that_is_not_a_float_vector_is_refused(ckpt, change, expected):
    """Found by fuzzing: these built, and the serving container failed (or served a BOOL norm)."""
    facts = _facts(ckpt)

    def edit(tensors):
        tensors["model.norm.weight"] = change(tensors)
    _rewrite(ckpt, edit)
    assert expected in _error(ckpt, facts)


def test_a_fifo_named_like_a_shard_is_refused_not_waited_on(ckpt):
    """Opening a fifo blocks until a writer comes: `lmc plan` and `lmc build` hung on one."""
    import os

    os.mkfifo(ckpt / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"extra\.safetensors: not a regular file$"):
        _facts(ckpt)
