"""Start-up: safe archive extraction, manifest verification, port, text tools, device pinning."""

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from lmc.errors import ArtifactError
from lmc.runtime.startup import (TextTools, default_request_timeout_s, extract_archive, open_artifact,
                                 resolve_port)
from lmc.runtime.workers import device_env, device_kind, groups_per_instance, processes_per_group
from lmc.testing.checkpoints import tokenizer_json
from runtime_fakes import CHAT_TEMPLATE, fake_plan, prompt_tokens, write_archive, write_artifact


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _info(name: str, kind=tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


@pytest.mark.parametrize("name,kind,reason", [
    ("/etc/evil", tarfile.REGTYPE, "absolute path"),
    ("shards/../../evil", tarfile.REGTYPE, "path escapes the archive"),
    ("a/../../evil", tarfile.REGTYPE, "path escapes the archive"),
    ("link", tarfile.SYMTYPE, "links are not allowed"),
    ("hard", tarfile.LNKTYPE, "links are not allowed"),
    ("dev", tarfile.CHRTYPE, "only regular files and directories"),
    ("fifo", tarfile.FIFOTYPE, "only regular files and directories"),
    ("d/" * 2000 + "f", tarfile.REGTYPE, "path more than 32 directories deep"),  # was a RecursionError (exit 70)
])
def test_unsafe_members_are_refused_before_anything_is_written(tmp_path, name, kind, reason):
    data = b"x" if kind == tarfile.REGTYPE else None
    archive = _tar(tmp_path / "model.tar.gz", [(_info("ok.txt"), b"fine"), (_info(name, kind, "/etc/passwd"), data)])
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ArtifactError, match=reason) as err:
        extract_archive(archive, dest)
    assert name in str(err.value) and "\n" not in str(err.value)
    assert list(dest.iterdir()) == []  # checked all members first
    assert not (tmp_path / "evil").exists() and not (dest.parent.parent / "evil").exists()


def test_archive_is_extracted_verified_and_cleaned_up(tmp_path):
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    archive = write_archive(model, tmp_path / "model.tar.gz")
    artifact = open_artifact(archive)
    try:
        assert artifact.plan["tensor_parallel_degree"] == 2
        assert (artifact.model_dir / "shards/tp2/rank1.safetensors").read_bytes() == (model / "shards/tp2/rank1.safetensors").read_bytes()
    finally:
        artifact.cleanup()
    assert not artifact.model_dir.exists()


@pytest.mark.parametrize("damage", ["crc", "truncated_trailer", "middle"])
def test_a_corrupt_gzip_is_refused_as_such(tmp_path, damage, monkeypatch):
    """gzip checks its CRC and length at the end of the stream, past the tar's end marker; a flipped
    byte in the middle ends tarfile's member list early, as if the archive ended there. Each is one
    line saying the archive cannot be read, and no extracted file is left."""
    monkeypatch.setenv("LMC_EXTRACT_DIR", str(tmp_path / "extract"))
    (tmp_path / "extract").mkdir()
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    archive = write_archive(model, tmp_path / "model.tar.gz")
    data = bytearray(archive.read_bytes())
    if damage == "crc":
        data[-6] ^= 0xFF
    elif damage == "truncated_trailer":
        del data[-8:]
    else:
        data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.tar\.gz: not a readable tar archive"):
        open_artifact(archive)
    assert list((tmp_path / "extract").iterdir()) == []


@pytest.mark.parametrize("damage", ["second_header", "trailing_data"])
def test_a_tar_that_ends_early_or_carries_more_is_refused_as_corrupt(tmp_path, damage):
    """A valid gzip around a bad tar: tarfile stops at a header it cannot read as if the archive ended,
    so the members after it vanished and start-up said "no manifest". Now only zero blocks may follow
    the last member tarfile read."""
    import gzip

    model = write_artifact(tmp_path / "m", fake_plan())
    tar_bytes = bytearray(gzip.decompress(write_archive(model, tmp_path / "model.tar.gz").read_bytes()))
    with tarfile.open(fileobj=io.BytesIO(bytes(tar_bytes))) as tar:
        members = tar.getmembers()
    if damage == "second_header":
        tar_bytes[members[1].offset + 148] ^= 0x05  # its checksum field
        last = members[0].name
    else:
        tar_bytes += b"\0" * 512 + b"more"
        last = members[-1].name
    (tmp_path / "model.tar.gz").write_bytes(gzip.compress(bytes(tar_bytes)))
    with pytest.raises(ArtifactError, match=f"corrupt tar archive: unreadable data after member '{last}'"):
        open_artifact(tmp_path / "model.tar.gz")


def test_an_archive_made_with_gnu_tar_is_accepted(tmp_path):
    import shutil
    import subprocess

    if shutil.which("tar") is None:
        pytest.skip("no tar here")
    model = write_artifact(tmp_path / "m", fake_plan())
    subprocess.run(["tar", "czf", str(tmp_path / "model.tar.gz"), "-C", str(model), "."], check=True)
    artifact = open_artifact(tmp_path / "model.tar.gz")
    try:
        assert (artifact.model_dir / "lmc.json").read_bytes() == (model / "lmc.json").read_bytes()
    finally:
        artifact.cleanup()


def test_one_changed_byte_stops_start_up_naming_the_file(tmp_path):
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    shard = model / "shards/tp2/rank1.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"rank1\.safetensors: altered: sha256 differs"):
        open_artifact(model)


def test_missing_dir_and_missing_plan_keys_are_clear(tmp_path):
    with pytest.raises(ArtifactError, match="no such model directory or archive"):
        open_artifact(tmp_path / "nope")
    plan = fake_plan()
    del plan["job_queue_size"]
    with pytest.raises(ArtifactError, match="plan lacks job_queue_size"):
        open_artifact(write_artifact(tmp_path / "m", plan))


def _edit_manifest(model: Path, edit) -> Path:
    manifest = json.loads((model / "lmc.json").read_text())
    edit(manifest)
    (model / "lmc.json").write_text(json.dumps(manifest))
    return model


def _set_plan(key, value):
    return lambda manifest: manifest["plan"].__setitem__(key, value)


@pytest.mark.parametrize("edit, message", [
    (_set_plan("replicas", 16), "lmc.json: altered: its plan does not match the plan sha256 in serving.properties"),
    (_set_plan("batch_size", 0), "lmc.json: altered: its plan does not match"),
    (_set_plan("engine", "neuronx"), "lmc.json: altered: its plan does not match"),
    (lambda m: m["spec"].__setitem__("workload", "x"), "lmc.json: altered: its spec does not match the spec sha256"),
    (lambda m: m["files"].pop("serving.properties"), "serving.properties: not listed in lmc.json"),
    (lambda m: m["files"]["config.json"].pop("size"), "files['config.json'] must be {\"size\": bytes, \"sha256\": 64 hex"),
    (lambda m: m["files"]["config.json"].pop("sha256"), "files['config.json'] must be"),
    (lambda m: m["files"].__setitem__("config.json", "x"), "files['config.json'] must be"),
    (lambda m: m["files"]["config.json"].__setitem__("size", "12"), "files['config.json'] must be"),
    (lambda m: m["files"].__setitem__("../outside", {"size": 1, "sha256": "0" * 64}), "files lists '../outside', not a path inside"),
    (lambda m: m.__setitem__("format_version", "1"), 'unsupported manifest format "1"; expected 1'),
], ids=["replicas", "batch_size", "engine", "spec", "no_binding_file", "no_size", "no_sha256", "entry_not_object",
        "size_a_string", "traversal", "version_a_string"])
def test_an_altered_manifest_is_one_line_before_anything_starts(tmp_path, edit, message):
    """lmc.json is the one file the manifest cannot hash: its plan and spec are bound to the digests in
    the hashed serving.properties, and its file entries are checked for shape. Each alteration is an
    ArtifactError from open_artifact, which runs before the first process starts (lmc runtime)."""
    model = _edit_manifest(write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2)), edit)
    with pytest.raises(ArtifactError) as info:
        open_artifact(model, check_hashes=False)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("change, message", [
    # A shard's entry removed, the shard kept (and free to be altered): it would be loaded unverified.
    (lambda m: _drop_entry(m, "shards/tp2/rank1.safetensors"), "shards/tp2/rank1.safetensors: not listed in lmc.json"),
    # The shard removed with its entry: caught here, not by a load that fails three times.
    (lambda m: (_drop_entry(m, "shards/tp2/rank1.safetensors"), (m / "shards/tp2/rank1.safetensors").unlink()),
     "lmc.json: lists no shards/tp2/rank1.safetensors, which its plan needs"),
    (lambda m: (_drop_entry(m, "model.py"), (m / "model.py").unlink()), "lmc.json: lists no model.py, which its plan needs"),
    (lambda m: (m / "extra.safetensors").write_bytes(b"x"), "extra.safetensors: not listed in lmc.json"),
    (lambda m: (m / "shards/tp2/notes").mkdir() or (m / "shards/tp2/notes/a.txt").write_text("x"),
     "shards/tp2/notes/a.txt: not listed in lmc.json"),
    (lambda m: (m / "shards/tp4").symlink_to(m / "shards/tp2"), "shards/tp4: links to a directory the artifact already has"),
    (lambda m: (m / "shards/tp2/up").symlink_to(m), "shards/tp2/up: links to a directory the artifact already has"),
    (lambda m: (m / "shards/__pycache__").mkdir() or (m / "shards/__pycache__/x.pyc").write_bytes(b"x"),
     "shards/__pycache__/x.pyc: not listed in lmc.json"),
], ids=["entry_removed", "file_and_entry_removed", "model_py_removed", "file_added", "nested_file_added", "dir_alias_added",
        "dir_loop_added", "nested_pycache"])
def test_files_the_manifest_does_not_vouch_for_are_refused(tmp_path, change, message):
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    change(model)
    with pytest.raises(ArtifactError) as info:
        open_artifact(model, check_hashes=False)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bytecode_the_runtime_writes_into_the_model_dir_is_allowed(tmp_path):
    """Importing model.py from a writable model dir leaves __pycache__ behind: a restart must not refuse it."""
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    (model / "__pycache__").mkdir()
    (model / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert open_artifact(model, check_hashes=False).model_dir == model


def test_a_directory_moved_elsewhere_and_linked_back_is_checked_through_the_link(tmp_path):
    """A shards/ put on another volume and linked back is still an artifact: every file is reached
    through the link and checked; a file added there is refused by its path inside the artifact."""
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    (model / "shards").rename(tmp_path / "volume")
    (model / "shards").symlink_to(tmp_path / "volume")
    assert open_artifact(model).model_dir == model
    (tmp_path / "volume" / "tp2" / "rank2.safetensors").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"m/shards/tp2/rank2\.safetensors: not listed in lmc\.json"):
        open_artifact(model, check_hashes=False)


def test_model_py_runs_from_its_source_not_from_a_pyc_beside_it(tmp_path):
    """__pycache__/ is let through the listing check, so a .pyc there must never be what runs: one
    whose recorded mtime and size match model.py's would be preferred by an import."""
    import importlib.util
    import marshal
    import struct

    from lmc.runtime.workers import load_model_module

    model = write_artifact(tmp_path / "m", fake_plan())
    source = model / "model.py"
    stat = source.stat()
    cache = Path(importlib.util.cache_from_source(str(source)))
    cache.parent.mkdir(exist_ok=True)
    code = compile("MARK = 'from the pyc'\ndef create_engine():\n    return None\n", str(source), "exec")
    cache.write_bytes(importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(stat.st_mtime), stat.st_size & 0xFFFFFFFF)
                      + marshal.dumps(code))
    assert open_artifact(model, check_hashes=True).model_dir == model
    module = load_model_module(model)
    assert not hasattr(module, "MARK") and "FakeEngine" in vars(module)
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name]  # and nothing more was written


def _drop_entry(model, rel):
    manifest = json.loads((model / "lmc.json").read_text())
    manifest["files"].pop(rel)
    (model / "lmc.json").write_text(json.dumps(manifest))


def test_a_rewritten_serving_properties_is_caught_before_the_plan_is_trusted(tmp_path):
    """Rewriting serving.properties to carry a tampered plan's digest changes that file's hash."""
    from lmc.manifest import digest_json

    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    manifest = json.loads((model / "lmc.json").read_text())
    manifest["plan"]["replicas"] = 16
    (model / "lmc.json").write_text(json.dumps(manifest))
    text = (model / "serving.properties").read_text().splitlines()
    text[1] = f"# plan sha256 {digest_json(dict(manifest['plan'], plan_sha256=''))}"
    (model / "serving.properties").write_text("\n".join(text) + "\n")
    with pytest.raises(ArtifactError, match=r"serving\.properties: altered"):
        open_artifact(model, check_hashes=False)


def test_port_precedence():
    assert resolve_port(None, {}) == 8080
    assert resolve_port(None, {"SAGEMAKER_BIND_TO_PORT": "9001"}) == 9001
    assert resolve_port(7000, {"SAGEMAKER_BIND_TO_PORT": "9001"}) == 7000
    with pytest.raises(ArtifactError, match="not a TCP port"):
        resolve_port(None, {"SAGEMAKER_BIND_TO_PORT": "http"})


def test_request_timeout_follows_the_plan_prediction():
    assert default_request_timeout_s(fake_plan()) == 120.0
    plan = fake_plan(predicted={"ttft_ms": 1000, "tpot_ms": 100}, max_sequence_length=1000)
    assert default_request_timeout_s(plan) == pytest.approx(1010.0)


def _with_tokenizer(model_dir: Path) -> Path:
    (model_dir / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    return model_dir


def test_chat_template_renders_with_the_generation_prompt(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    tools = TextTools(_with_tokenizer(tmp_path))
    prompt = tools.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert prompt == "<system> be brief <user> hi <assistant>"
    assert tools.count_tokens([prompt, ""]) == [prompt_tokens(prompt), 0] == [30, 0]  # 6 words, 30 tokens


def test_an_artifact_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    """Prompts are counted with the model's tokenizer or not at all: no word counts stand in for it."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    with pytest.raises(ArtifactError) as caught:
        TextTools(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{tmp_path}: no tokenizer files (expected one of tokenizer.json, ")
    assert "vocab.json + merges.txt" in message and "build the artifact from a checkpoint that has one" in message
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ArtifactError, match=r"transformers cannot read its tokenizer: \w+") as caught:
        TextTools(tmp_path)
    assert "\n" not in str(caught.value)


def test_lmc_runtime_refuses_an_artifact_without_a_tokenizer_at_start(tmp_path):
    import subprocess
    import sys

    model = write_artifact(tmp_path / "m", fake_plan(), tokenizer=False)
    done = subprocess.run([sys.executable, "-m", "lmc", "runtime", "--model-dir", str(model), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("lmc: error:")]
    assert done.returncode == 1, done.stderr
    assert len(errors) == 1 and f"{model}: no tokenizer files" in errors[0], done.stderr


def _bpe_vocab_files(model_dir: Path) -> Path:
    """The tiny checkpoints' byte-level BPE as GPT-2's files (vocab.json + merges.txt), no tokenizer.json."""
    from tokenizers import Tokenizer

    model_dir.mkdir()
    Tokenizer.from_str(tokenizer_json()).model.save(str(model_dir))
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return model_dir


def _sentencepiece_files(model_dir: Path, name: str, model_type: str) -> Path:
    """A sentencepiece model trained on the tiny checkpoints' text, as `name` (Llama's tokenizer.model,
    T5's spiece.model), no tokenizer.json."""
    spm = pytest.importorskip("sentencepiece")
    from lmc.testing.checkpoints import _TRAINING_TEXT

    model_dir.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_TRAINING_TEXT.splitlines()), model_prefix=str(model_dir / "sp"),
                                   vocab_size=200, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=3,
                                   minloglevel=2)
    (model_dir / "sp.model").rename(model_dir / name)
    (model_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
    return model_dir


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?", "zebra quantum 42"]


@pytest.mark.parametrize("kind", ["vocab.json + merges.txt", "tokenizer.model", "spiece.model"])
def test_prompts_are_counted_with_a_tokenizer_that_has_no_tokenizer_json(tmp_path, kind):
    """The other tokenizer files lmc build accepts are read through transformers' AutoTokenizer: the
    counts are its counts (with and without special tokens), not words."""
    transformers = pytest.importorskip("transformers")
    if kind == "vocab.json + merges.txt":
        model_dir = _bpe_vocab_files(tmp_path / "m")
    else:
        model_dir = _sentencepiece_files(tmp_path / "m", kind, "llama" if kind == "tokenizer.model" else "t5")
    assert not (model_dir / "tokenizer.json").exists()
    tools = TextTools(model_dir)
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    for special in (True, False):
        expected = [len(reference(text, add_special_tokens=special)["input_ids"]) for text in TEXTS]
        assert tools.count_tokens(TEXTS, special) == expected
    assert tools.count_tokens(TEXTS) != [len(text.split()) for text in TEXTS]
    assert tools.vocab_size == len(reference)
    if kind == "vocab.json + merges.txt":  # the same BPE as the tiny checkpoints' tokenizer.json: the same ids
        assert [tools.encode(text) for text in TEXTS] == [
            reference(text)["input_ids"] for text in TEXTS] == [
            TextTools(_with_tokenizer(tmp_path)).encode(text) for text in TEXTS]


def test_chat_without_a_template_says_what_to_use(tmp_path):
    with pytest.raises(ValueError, match="no chat template.*use /v1/completions"):
        TextTools(_with_tokenizer(tmp_path)).render_chat([{"role": "user", "content": "hi"}])


def test_template_raise_exception_becomes_a_value_error(tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    _with_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="first must be user"):
        TextTools(tmp_path).render_chat([{"role": "system", "content": "s"}])


def test_devices_are_pinned_in_contiguous_ranges_per_group():
    gpu = fake_plan(engine="deepspeed", tensor_parallel_degree=2, replicas=2,
                    target={"accelerator": "a10g", "instances": 1})
    assert device_kind(gpu) == "gpu"
    assert device_env(gpu, group=1, local_rank=1) == {"CUDA_VISIBLE_DEVICES": "2,3", "LOCAL_RANK": "1"}
    neuron = fake_plan(engine="neuronx", tensor_parallel_degree=4, replicas=2,
                       target={"accelerator": "inferentia2", "instances": 1})
    assert device_env(neuron, group=1, local_rank=0)["NEURON_RT_VISIBLE_CORES"] == "4-7"
    assert processes_per_group(neuron) == 1  # transformers-neuronx drives all cores from one process
    assert processes_per_group(gpu) == 2
    assert "CUDA_VISIBLE_DEVICES" not in device_env(fake_plan(), 0, 0)


def test_replicas_are_spread_over_instances():
    assert groups_per_instance(fake_plan(replicas=4, target={"accelerator": "a10g", "instances": 2})) == 2
    assert groups_per_instance(fake_plan(replicas=3, target={"accelerator": "a10g", "instances": 2})) == 2
    assert groups_per_instance(fake_plan(replicas=1)) == 1


def test_a_file_that_is_not_an_archive_is_one_line(tmp_path):
    bogus = tmp_path / "model.tar.gz"
    bogus.write_bytes(b"not gzip")
    with pytest.raises(ArtifactError, match=r"model\.tar\.gz: not a readable tar archive") as err:
        extract_archive(bogus, tmp_path / "dest")
    assert "\n" not in str(err.value)


def test_a_windows_style_member_path_is_refused(tmp_path):
    archive = _tar(tmp_path / "model.tar.gz", [(_info("shards\\..\\evil"), b"x")])
    with pytest.raises(ArtifactError, match="empty or non-POSIX path; refusing to extract"):
        extract_archive(archive, tmp_path / "dest")


def test_a_member_path_with_a_nul_byte_is_refused(tmp_path):
    """A PAX header can carry any bytes in a path: a NUL was a ValueError from open() (exit 70)."""
    with tarfile.open(tmp_path / "model.tar.gz", "w:gz", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("placeholder")
        info.pax_headers = {"path": "a\0b"}
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ArtifactError, match=r"member 'a\\x00b': empty or non-POSIX path"):
        extract_archive(tmp_path / "model.tar.gz", tmp_path / "dest")


def test_a_corrupt_xz_archive_is_one_line(tmp_path):
    """tarfile opens .tar.xz too; lzma's own error was not caught (exit 70)."""
    model = write_artifact(tmp_path / "m", fake_plan())
    archive = tmp_path / "model.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(model, arcname=".")
    data = bytearray(archive.read_bytes())
    data[-20] ^= 0xFF  # in the stream's index, read after the members (a byte in the middle fails at open)
    archive.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.tar\.xz: not a readable tar archive"):
        open_artifact(archive)


@pytest.mark.parametrize("make, message", [
    (lambda path: os.mkfifo(path), "lmc.json: not a regular file"),  # read, it hung start-up for good
    (lambda path: path.write_text('{"format_version": 1, "files": {"a": {"size": ' + "9" * 5000 + "}}}"),
     "lmc.json: unreadable manifest: Exceeds the limit"),  # Python refuses a 5000-digit int: was exit 70
])
def test_a_manifest_that_cannot_be_read_is_one_line_at_once(tmp_path, make, message):
    model = write_artifact(tmp_path / "m", fake_plan())
    (model / "lmc.json").unlink()
    make(model / "lmc.json")
    with pytest.raises(ArtifactError, match=message) as err:
        open_artifact(model, check_hashes=False)
    assert "\n" not in str(err.value)


def test_a_manifest_larger_than_any_lmc_writes_is_refused_unread(tmp_path, monkeypatch):
    import lmc.manifest

    model = write_artifact(tmp_path / "m", fake_plan())
    monkeypatch.setattr(lmc.manifest, "_MAX_MANIFEST_BYTES", (model / "lmc.json").stat().st_size - 1)
    with pytest.raises(ArtifactError, match=r"lmc\.json: larger than"):
        open_artifact(model, check_hashes=False)


def test_a_directory_that_cannot_be_listed_stops_start_up(tmp_path, monkeypatch):
    """os.walk skips a directory it cannot read, and every file in it, unless told otherwise (as root
    with the permission-bypass capabilities dropped, a mode-311 shards/tp2 hid an unlisted file)."""
    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    real_scandir = os.scandir
    hidden = str(model / "shards" / "tp2")

    def scandir(path="."):
        if os.fspath(path) == hidden:
            raise PermissionError(13, "Permission denied", hidden)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ArtifactError, match=r"shards/tp2: cannot be listed: Permission denied"):
        open_artifact(model, check_hashes=False)


@pytest.mark.parametrize("rank, world", [(2, 2), (-1, 2), ("1", 2), (0, None), (True, 2)])
def test_verify_for_rank_refuses_a_rank_outside_its_world(tmp_path, rank, world):
    from lmc.runtime.startup import verify_for_rank

    model = write_artifact(tmp_path / "m", fake_plan(tensor_parallel_degree=2))
    with pytest.raises(ArtifactError, match="not a rank of that world"):
        verify_for_rank(model, rank, world)


@pytest.mark.parametrize("size", [0, 1, 1024 * 1024, 3 * 1024 * 1024 + 7])
def test_sha256_file_matches_hashlib_across_chunk_edges(tmp_path, size):
    import hashlib

    from lmc.manifest import sha256_file

    data = bytes((i * 131 + i // 4099) % 256 for i in range(size))
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


# Exercises what transformers' apply_chat_template gives a template beyond plain jinja: tools/documents
# passed as None, strftime_now, dict, namespace, loop controls, its tojson options, special tokens.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(system='') %}
{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endif %}{% endfor %}
{% if tools is not none %}TOOLS {{ tools | tojson(indent=2) }}{% endif %}
{% if documents is not none %}DOCUMENTS{% endif %}
date {{ strftime_now("%Y-%m-%d") }} system {{ ns.system | tojson }}
{{ dict(n=messages | length, first=messages[0]['role']) | tojson(sort_keys=True, separators=(",", ":")) }}
{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}
[{{ m['role'] }}] {{ m['content'] | tojson(ensure_ascii=True) }} {{ m['content'] }}{{ eos_token }}{{ sep_token }}
{% endfor %}{% if add_generation_prompt %}[assistant]{{ pad_token }}{% endif %}"""


@pytest.mark.parametrize("layout", ["config", "legacy-map-only", "legacy-map-wins", "modern-ignores-map"])
def test_chat_templates_render_as_transformers_apply_chat_template(tmp_path, layout):
    transformers = pytest.importorskip("transformers")
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "ckpt")
    config_path, map_path = checkpoint / "tokenizer_config.json", checkpoint / "special_tokens_map.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = RICH_TEMPLATE
    special_map = json.loads(map_path.read_text())
    if layout == "legacy-map-only":  # an older checkpoint: the token only in the legacy file
        del config["bos_token"]
    elif layout == "legacy-map-wins":  # the two files disagree: transformers takes the map's
        special_map["eos_token"] = "<unk>"
    elif layout == "modern-ignores-map":  # a config saved with added_tokens_decoder: the map is not read
        config["added_tokens_decoder"] = {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                                   "normalized": False, "single_word": False}
                                          for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"])}
        del config["pad_token"]
        special_map["pad_token"] = "<pad>"
    config_path.write_text(json.dumps(config))
    map_path.write_text(json.dumps(special_map))
    messages = [{"role": "system", "content": "be <b>brief</b>"}, {"role": "user", "content": "wörld \"quoted\""},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<s>" in expected and "wörld" in expected and "TOOLS" not in expected  # the template's branches ran
    assert TextTools(checkpoint).render_chat(messages) == expected
