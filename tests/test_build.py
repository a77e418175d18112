"""`lmc build` end to end on tiny local checkpoints: layout, determinism, manifest, failures leave nothing."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
import types
from pathlib import Path

import pytest

from lmc.cli.main import main

TP2_SPEC = """\
[model]
id = "tiny/llama"
path = "{path}"

[target]
instance = "local"
profile = "cpu2.toml"

[workload]
max_input_tokens = 32
max_output_tokens = 16
concurrency = 2

[pin]
engine = "hf"
dtype = "{dtype}"
tensor_parallel_degree = 2
"""

NEURON_SPEC = """\
[model]
id = "tiny/llama"
path = "{path}"

[target]
instance = "ml.inf2.xlarge"

[workload]
max_input_tokens = 32
max_output_tokens = 16
concurrency = 1

[pin]
engine = "neuronx"
dtype = "bf16"
"""


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> Path:
    from lmc.testing.checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


# `local` is one device (the whole CPU); tensor-parallel ranks on a CPU are processes, so the tests
# describe this machine as two devices with a profile over `local`.
CPU_PROFILE = """\
base = "local"
devices = 2
device_memory_bytes = "8GiB"
"""


def write_spec(tmp_path: Path, checkpoint: Path, template: str = TP2_SPEC, dtype: str = "fp32") -> Path:
    (tmp_path / "cpu2.toml").write_text(CPU_PROFILE, encoding="utf-8")
    spec = tmp_path / "spec.toml"
    spec.write_text(template.format(path=checkpoint.as_posix(), dtype=dtype), encoding="utf-8")
    return spec


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def assert_nothing_left(out: Path) -> None:
    assert not out.exists(), f"{out} was left behind"
    parent = out.parent
    if parent.is_dir():
        leftovers = [p.name for p in parent.iterdir() if ".staging-" in p.name or p.name.startswith(f".{out.name}")]
        assert leftovers == [], leftovers


def test_build_is_byte_identical_and_has_the_design_layout(tmp_path, llama_checkpoint, capsys):
    spec = write_spec(tmp_path, llama_checkpoint)
    first, second = tmp_path / "a" / "model.tar.gz", tmp_path / "b" / "model.tar.gz"
    first.parent.mkdir()
    second.parent.mkdir()

    code, out, err = run_cli(capsys, "build", str(spec), "-o", str(first))
    assert code == 0, err
    assert run_cli(capsys, "build", str(spec), "-o", str(second))[0] == 0
    assert first.read_bytes() == second.read_bytes()

    files = members(first)
    expected = {"serving.properties", "model.py", "requirements.txt", "lmc.json", "config.json",
                "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "shards/tp2/rank0.safetensors", "shards/tp2/rank1.safetensors"}
    assert expected <= set(files), sorted(files)
    assert not any(name.endswith(".bin") or name == "model.safetensors" for name in files)

    # The summary names the plan, the files and the archive's digest.
    digest = hashlib.sha256(first.read_bytes()).hexdigest()
    assert f"sha256 {digest}" in out
    assert "hf fp32, TP 2" in out
    assert "shards/tp2/rank1.safetensors" in out


def test_a_reviewed_plan_builds_and_a_hand_edited_one_is_refused(tmp_path, llama_checkpoint, capsys):
    """`--plan` compared the file's plan_sha256 only: a plan edited by hand (here its TP degree, as a PR could)
    kept the digest of the plan lmc makes, so the build went ahead with a plan the reviewers had not read.
    Found by fuzzing the reviewed plan's fields (207 edits of 223 were built)."""
    spec = write_spec(tmp_path, llama_checkpoint)
    code, out, _ = run_cli(capsys, "plan", "--json", str(spec))
    reviewed = json.loads(out)
    (tmp_path / "plan.json").write_text(json.dumps(reviewed, indent=4))  # reformatted, not edited: still the plan
    built = tmp_path / "model.tar.gz"
    assert run_cli(capsys, "build", str(spec), "--plan", str(tmp_path / "plan.json"), "-o", str(built))[0] == 0
    built.unlink()
    (tmp_path / "plan.json").write_text(json.dumps(dict(reviewed, tensor_parallel_degree=1)))
    code, _, err = run_cli(capsys, "build", str(spec), "--plan", str(tmp_path / "plan.json"), "-o", str(built))
    assert code == 1 and err.count("\n") == 1
    assert f"the reviewed plan was edited after `lmc plan --json` wrote it (its content does not match its " \
           f"plan_sha256 {reviewed['plan_sha256'][:12]})" in err
    assert_nothing_left(built)


def test_manifest_lists_every_file_with_its_hash(tmp_path, llama_checkpoint, capsys):
    out = tmp_path / "model.tar.gz"
    assert run_cli(capsys, "build", str(write_spec(tmp_path, llama_checkpoint)), "-o", str(out))[0] == 0
    files = members(out)
    manifest = json.loads(files.pop("lmc.json"))
    assert set(manifest["files"]) == set(files)
    for name, data in files.items():
        entry = manifest["files"][name]
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert manifest["plan"]["engine"] == "hf" and manifest["plan"]["tensor_parallel_degree"] == 2
    assert manifest["spec"]["pin"]["dtype"] == "fp32"
    assert list(manifest["files"]) == sorted(manifest["files"])


def test_shards_are_in_the_planned_dtype(tmp_path, llama_checkpoint, capsys):
    from safetensors import safe_open

    out = tmp_path / "model"
    code, _, err = run_cli(capsys, "build", str(write_spec(tmp_path, llama_checkpoint, dtype="bf16")),
                           "-o", str(out), "--format", "dir")
    assert code == 0, err
    assert (out / "serving.properties").is_file()
    with safe_open(str(out / "shards/tp2/rank0.safetensors"), framework="pt") as handle:
        dtypes = {str(handle.get_slice(name).get_dtype()) for name in handle.keys()}
    assert dtypes == {"BF16"}
    from lmc.manifest import verify_artifact

    assert verify_artifact(out)["plan"]["dtype"] == "bf16"


def expect_failure(capsys, spec: Path, out: Path, *needles: str, extra: tuple[str, ...] = ()) -> str:
    code, stdout, err = run_cli(capsys, "build", str(spec), "-o", str(out), *extra)
    assert code == 1, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmc: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in err
    assert_nothing_left(out)
    return lines[0]


def copy_checkpoint(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def test_missing_checkpoint(tmp_path, capsys):
    spec = write_spec(tmp_path, tmp_path / "nowhere")
    expect_failure(capsys, spec, tmp_path / "model.tar.gz", "model.path", "no such checkpoint directory")


def test_truncated_safetensors(tmp_path, llama_checkpoint, capsys):
    ckpt = copy_checkpoint(llama_checkpoint, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    expect_failure(capsys, write_spec(tmp_path, ckpt), tmp_path / "model.tar.gz", "model.safetensors")


def test_shape_disagreeing_with_config(tmp_path, llama_checkpoint, capsys):
    ckpt = copy_checkpoint(llama_checkpoint, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] * 2
    (ckpt / "config.json").write_text(json.dumps(config))
    expect_failure(capsys, write_spec(tmp_path, ckpt), tmp_path / "model.tar.gz", "shape")


def test_pickle_checkpoint_needs_allow_pickle(tmp_path, llama_checkpoint, capsys):
    import torch
    from safetensors.torch import load_file

    ckpt = copy_checkpoint(llama_checkpoint, tmp_path / "ckpt")
    torch.save(load_file(str(ckpt / "model.safetensors")), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    expect_failure(capsys, write_spec(tmp_path, ckpt), tmp_path / "model.tar.gz", "--allow-pickle")


def test_unwritable_output_path(tmp_path, llama_checkpoint, capsys):
    spec = write_spec(tmp_path, llama_checkpoint)
    expect_failure(capsys, spec, tmp_path / "no" / "such" / "model.tar.gz", "cannot write the artifact")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    expect_failure(capsys, spec, blocker / "model.tar.gz", "is not a directory")


def test_an_output_path_that_would_replace_an_input_or_a_device_is_refused(tmp_path, llama_checkpoint, capsys):
    """-o naming the spec, its profile, a file in the checkpoint or a fifo: exit 1, one line, before any
    work, and every input byte for byte as it was (the rename at the end would have replaced it)."""
    ckpt = copy_checkpoint(llama_checkpoint, tmp_path / "ckpt")
    spec = write_spec(tmp_path, ckpt)
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    inputs = [spec, tmp_path / "cpu2.toml", *sorted(p for p in ckpt.iterdir() if p.is_file())]
    before = {path: path.read_bytes() for path in inputs}
    cases = [(spec, "is an input of this build"), (tmp_path / "cpu2.toml", "is an input of this build"),
             (ckpt / "model.safetensors", "is inside the checkpoint"), (ckpt / "new.tar.gz", "is inside the checkpoint"),
             (fifo, "exists and is not a regular file")]
    for out, needle in cases:
        code, _, err = run_cli(capsys, "build", str(spec), "-o", str(out))
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("lmc: error: ") and needle in lines[0], (out, err)
    assert {path: path.read_bytes() for path in inputs} == before
    assert not (ckpt / "new.tar.gz").exists() and fifo.is_fifo()
    assert [p.name for p in tmp_path.rglob("*") if ".staging-" in p.name] == []


def test_neuronx_without_the_sdk_stops_before_any_work(tmp_path, llama_checkpoint, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)
    # If the build read a weight before checking the SDK, this would be called.
    import lmc.emitters.neuron as neuron

    import lmc.emitters.build as build
    import lmc.emitters.checkpoint as checkpoint

    monkeypatch.setattr(neuron, "run_neuron_compile", lambda *a, **k: pytest.fail("compiled without the SDK"))
    monkeypatch.setattr(checkpoint, "validate_checkpoint", lambda *a, **k: pytest.fail("validated before the SDK check"))
    monkeypatch.setattr(build, "_stage_neuron_weights", lambda *a, **k: pytest.fail("read weights without the SDK"))
    spec = write_spec(tmp_path, llama_checkpoint, template=NEURON_SPEC)
    line = expect_failure(capsys, spec, tmp_path / "model.tar.gz", "pip install transformers-neuronx",
                          "Neuron")
    assert "inf2/trn1" in line


def test_neuronx_build_with_a_fake_sdk(tmp_path, llama_checkpoint, capsys, monkeypatch):
    calls = []

    class Llama:
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            calls.append((sorted(p.name for p in Path(path).iterdir()), kwargs))
            return cls()

        def to_neuron(self):
            calls.append("to_neuron")

        def save(self, directory):
            Path(directory, "llama.neff").write_bytes(b"NEFF")

    sdk = types.ModuleType("transformers_neuronx")
    sdk.__version__ = "0.10.0.21"
    sdk.LlamaForSampling = Llama
    monkeypatch.setitem(sys.modules, "transformers_neuronx", sdk)
    out = tmp_path / "model.tar.gz"
    code, _, err = run_cli(capsys, "build", str(write_spec(tmp_path, llama_checkpoint, template=NEURON_SPEC)),
                           "-o", str(out))
    assert code == 0, err
    files = members(out)
    assert {"model.safetensors", "config.json", "neuron/compiled/llama.neff", "neuron/compile.json",
            "neuron/README.md", "serving.properties", "model.py", "lmc.json"} <= set(files)
    assert not any(name.startswith("shards/") for name in files)
    staged, kwargs = calls[0]
    assert "model.safetensors" in staged and "config.json" in staged  # compiled against the cast checkpoint
    assert kwargs["amp"] == "bf16" and kwargs["n_positions"] >= 48
    assert calls[1] == "to_neuron"
    props = files["serving.properties"].decode()
    assert "option.compiled_graph_path=neuron/compiled" in props
    assert json.loads(files["neuron/compile.json"])["compiled"] is True


def test_remote_uri_packs_no_weights(tmp_path, llama_checkpoint, capsys):
    spec = write_spec(tmp_path, llama_checkpoint)
    spec.write_text(spec.read_text().replace('path = "', 'uri = "s3://bucket/tiny-llama/"\npath = "'), encoding="utf-8")
    out = tmp_path / "model.tar.gz"
    code, _, err = run_cli(capsys, "build", str(spec), "-o", str(out))
    assert code == 0, err
    files = members(out)
    assert set(files) == {"serving.properties", "model.py", "requirements.txt", "lmc.json"}
    assert b"option.model_id=s3://bucket/tiny-llama/\n" in files["serving.properties"]


def test_usage_error_for_unknown_format(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["build", str(tmp_path / "spec.toml"), "--format", "zip"])
    assert info.value.code == 2
    assert "invalid choice: 'zip'" in capsys.readouterr().err


def test_catalog_model_without_path_or_uri_has_nothing_to_pack(tmp_path, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text('[model]\nid = "EleutherAI/gpt-j-6b"\n\n[target]\ninstance = "ml.g5.12xlarge"\n', encoding="utf-8")
    line = expect_failure(capsys, spec, tmp_path / "model.tar.gz", "nothing to pack", "`path`", "`uri`")
    assert f"{spec}:1: model" in line


def test_dir_output_that_is_not_an_artifact_is_refused_before_any_weight_is_read(tmp_path, llama_checkpoint, capsys,
                                                                                   monkeypatch):
    import lmc.emitters.partition as partition

    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(partition, "partition_checkpoint", lambda *a, **k: pytest.fail("partitioned first"))
    code, _, err = run_cli(capsys, "build", str(write_spec(tmp_path, llama_checkpoint)), "--format", "dir",
                           "-o", str(out))
    assert code == 1 and "is not empty and is not an lmc artifact" in err
    assert (out / "notes.txt").read_text() == "mine"


def test_a_write_error_while_staging_is_one_line_exit_1_and_nothing_left(tmp_path, llama_checkpoint, capsys,
                                                                          monkeypatch):
    import errno

    import lmc.emitters.partition as partition

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.safetensors"))

    monkeypatch.setattr(partition, "partition_checkpoint", disk_full)
    expect_failure(capsys, write_spec(tmp_path, llama_checkpoint), tmp_path / "model.tar.gz",
                   "cannot build the artifact", "No space left on device")


def test_sigterm_during_a_build_unwinds_like_ctrl_c():
    import os
    import signal
    import time

    from lmc.cli.build import _interruptible

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        _interruptible(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))
    assert signal.getsignal(signal.SIGTERM) is previous  # restored
