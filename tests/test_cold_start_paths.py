"""Cold-start paths of `lmc runtime`: shards mapped without copies (every dtype, malformed files as one-line
errors), the loaded model's parameters living in the mapping, and the fork server that ranks come from."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

try:
    from _engine_helpers import build_artifact, make_checkpoint
except ImportError:  # tests/ imported as a package
    from tests._engine_helpers import build_artifact, make_checkpoint

from lmc.errors import ArtifactError
from lmc.runtime.engines import hf
from lmc.runtime.engines.hf import read_shard
from lmc.runtime.workers import mp_context, preload_modules
from lmc.safetensors_header import HeaderError, parse_header, read_header

REPO = Path(__file__).resolve().parent.parent


def _tensors() -> dict:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=generator)
    return {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "i8": (base * 40).to(torch.int8),
        "f8": base.to(torch.float8_e4m3fn),
        "i64": torch.arange(7),
        "empty": torch.zeros(0, 4),
    }


def _write(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_every_dtype_round_trips_as_views_of_one_mapping(tmp_path):
    from safetensors.torch import save_file

    tensors = _tensors()
    path = tmp_path / "rank0.safetensors"
    save_file(tensors, path)
    state = read_shard(path)
    assert set(state) == set(tensors)
    for name, tensor in tensors.items():
        assert state[name].dtype == tensor.dtype and state[name].shape == tensor.shape, name
        assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    # Views of one mapping: the distance between two tensors in memory is their distance in the file.
    entries = read_header(path).tensors
    first, second = entries["f32"], entries["i64"]
    assert state["i64"].data_ptr() - state["f32"].data_ptr() == second.begin - first.begin


def test_writing_a_mapped_tensor_never_changes_the_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "rank0.safetensors"
    save_file({"w": torch.ones(4)}, path)
    before = path.read_bytes()
    state = read_shard(path)
    state["w"].mul_(3)
    assert state["w"].tolist() == [3.0] * 4
    assert path.read_bytes() == before


def test_an_unaligned_tensor_is_read_correctly(tmp_path):
    # Not what safetensors writers produce, but the format allows it: F32 data at an odd offset.
    values = torch.tensor([1.5, -2.0, 3.25])
    header = {"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "w": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]}}
    path = _write(tmp_path / "odd.safetensors", header, b"\x07" + values.numpy().tobytes())
    state = read_shard(path)
    assert state["w"].tolist() == values.tolist() and state["pad"].tolist() == [7]


@pytest.mark.parametrize("header, data, message", [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8,
     "tensor 'w' ends at byte"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16,
     "tensor 'w' spans 12 bytes; F32 x [4] needs 16"),
    ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4,
     "tensor 'w' has unknown dtype 'Q4'"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4,
     "tensor 'w' has an invalid shape [-1]"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4,
     "tensor 'w' has invalid data_offsets [4, 0]"),
])
def test_a_malformed_header_is_a_one_line_artifact_error_naming_the_file(tmp_path, header, data, message):
    path = _write(tmp_path / "rank0.safetensors", header, data)
    with pytest.raises(ArtifactError) as excinfo:
        read_shard(path)
    text = str(excinfo.value)
    assert text.startswith(f"{path}: not a readable safetensors file (") and message in text
    assert "\n" not in text


def test_a_truncated_or_foreign_file_is_an_artifact_error(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ArtifactError, match=r"short\.safetensors: not a readable safetensors file \(2 bytes, too short"):
        read_shard(short)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ArtifactError, match=r"header of 1099511627776 bytes does not fit in the 10-byte file"):
        read_shard(huge)
    text = tmp_path / "text.safetensors"
    text.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ArtifactError, match=r"text\.safetensors: not a readable safetensors file \(header is not valid JSON"):
        read_shard(text)


def test_parse_header_ignores_metadata_and_orders_by_offset():
    raw = json.dumps({"__metadata__": {"format": "pt"},
                      "b": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]},
                      "a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    metadata, entries = parse_header(raw, 8 + len(raw) + 8)
    assert metadata == {"format": "pt"}
    assert list(entries) == ["a", "b"]
    assert entries["b"].begin == 8 + len(raw) + 4
    with pytest.raises(HeaderError, match="header is not a JSON object"):
        parse_header(b"[1]", 100)


def test_the_loaded_models_parameters_are_the_mapped_tensors(tmp_path, monkeypatch):
    from lmc.runtime.engines import create_engine

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    artifact = build_artifact(checkpoint, tmp_path / "art", 1)
    mapped: dict = {}

    def recording_read_shard(path):
        state = read_shard(path)
        mapped.update(state)
        return state

    monkeypatch.setattr(hf, "read_shard", recording_read_shard)
    engine = create_engine("hf", family="llama", task="text-generation", dtype="fp32", tensor_parallel_degree=1,
                           max_sequence_length=64, batch_size=1, device="cpu")
    engine.load(artifact, 0, 1)
    pointers = {tensor.data_ptr() for tensor in mapped.values()}
    parameters = dict(engine.model.named_parameters())
    assert len(parameters) == len(mapped)
    copied = [name for name, param in parameters.items() if param.data_ptr() not in pointers]
    assert copied == []


def test_cpu_ranks_fork_from_a_server_that_preloads_the_engine_and_family_and_device_ranks_are_spawned():
    cpu_plan = {"engine": "deepspeed", "model": {"family": "gptj"}, "target": {"accelerator": "cpu"}}
    assert mp_context(cpu_plan).get_start_method() == "forkserver"
    # A library that initialises CUDA (or the Neuron runtime) at import would poison every forked rank.
    assert mp_context({**cpu_plan, "target": {"accelerator": "a10g"}}).get_start_method() == "spawn"
    assert mp_context({"engine": "neuronx", "target": {"accelerator": "inferentia2"}}).get_start_method() == "spawn"
    modules = preload_modules(cpu_plan)
    assert {"torch", "transformers.modeling_utils", "transformers.models.gptj.modeling_gptj", "deepspeed",
            "lmc.runtime.engines.hf", "lmc.runtime.workers"} <= set(modules)
    assert modules[0] == "lmc.runtime.preload"  # it pauses the collector for everything after it
    odd = preload_modules({"engine": "hf", "model": {"family": "../x"}})
    assert "transformers.modeling_utils" in odd and not any("../x" in m for m in odd)


_SERVER_PROBE = r"""
import os, signal, sys, time
from multiprocessing import forkserver
from lmc.runtime.workers import mp_context, start_process_server
plan = {"engine": "fake", "model": {"family": "llama"}, "target": {"accelerator": "cpu"}}
start_process_server({"engine": "hf", "target": {"accelerator": "a10g"}})  # spawned ranks: no server
assert forkserver._forkserver._forkserver_pid is None
start_process_server(plan)
proc = mp_context(plan).Process(target=time.sleep, args=(0.1,))
proc.start(); proc.join(30)
pid = forkserver._forkserver._forkserver_pid
os.kill(pid, signal.SIGTERM)
time.sleep(0.5)
alive = os.waitpid(pid, os.WNOHANG)[0] == 0
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the front end's own disposition is restored
proc = mp_context(plan).Process(target=time.sleep, args=(0.1,))
proc.start(); proc.join(30)
print(alive, proc.exitcode)
"""


def test_the_fork_server_survives_a_sigterm_to_the_process_group():
    out = subprocess.run([sys.executable, "-c", _SERVER_PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "0"]
