"""The artifact manifest (`lmc.json`): format version, lmc version, spec, plan, every file's digest.

Shared by the build (which writes it) and the runtime (which verifies it before loading).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

from lmc.errors import ArtifactError
from lmc.layouts import pipeline_degree, shard_path

MANIFEST_NAME = "lmc.json"
FORMAT_VERSION = 1
_CHUNK = 1024 * 1024
_MAX_MANIFEST_BYTES = 64 << 20  # a spec, a plan and ~120 bytes per file: lmc's are a few KiB
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The hashed file whose header carries the spec's and the plan's digests (see check_binding).
BINDING_FILE = "serving.properties"
# What importing model.py (DJL Serving does; lmc runs it from source) may add to a writable model dir.
# lmc never reads it: model.py is the one Python file in an artifact, and it sits at the top.
_BYTECODE_DIR = "__pycache__"
# vLLM's sharded_state files (its ShardedStateLoader's TP-only pattern), in a vLLM artifact's top level.
VLLM_SHARDED_STATE = "model-rank-{rank}-part-{part}.safetensors"
# The tokenizer files an artifact carries, any one group of them (a fast tokenizer, sentencepiece, or
# BPE/WordPiece vocab files): the build refuses a checkpoint without one, the runtime an artifact.
TOKENIZER_MODELS = (("tokenizer.json",), ("tokenizer.model",), ("spiece.model",), ("vocab.json", "merges.txt"),
                    ("vocab.txt",))


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """The file's sha256, read into one reused buffer: a fresh 8 MiB `bytes` per read cost ~15 % more
    CPU (page faults and copies), taken from the fork server's imports beside it at runtime start.
    Not mmap: a file truncated while it is hashed would kill the process with SIGBUS, not an error.
    Raises InterruptedError at the next chunk once `stop` is set."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            if stop is not None and stop.is_set():
                raise InterruptedError(f"{path}: hashing stopped")
            digest.update(view[:count])
    return digest.hexdigest()


def build_manifest(lmc_version: str, spec: dict[str, Any], plan: dict[str, Any],
                   files: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """The manifest for `files` ({relative path: (size, sha256)}), paths sorted."""
    return {
        "format_version": FORMAT_VERSION,
        "lmc_version": lmc_version,
        "spec": spec,
        "plan": plan,
        "files": {path: {"size": size, "sha256": digest} for path, (size, digest) in sorted(files.items())},
    }


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode()


def read_manifest(model_dir: Path) -> dict[str, Any]:
    path = model_dir / MANIFEST_NAME
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a fifo would hang start-up, /dev/zero fill the memory
            raise ArtifactError(f"{path}: not a regular file")
        with open(path, "rb") as handle:
            data = handle.read(_MAX_MANIFEST_BYTES + 1)
        if len(data) > _MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{path}: larger than {_MAX_MANIFEST_BYTES >> 20} MiB; not a manifest lmc wrote")
        manifest = json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no manifest; is this an artifact built by `lmc build`?") from None
    except (OSError, ValueError) as exc:  # ValueError: bad UTF-8, bad JSON, an integer of 5000 digits
        raise ArtifactError(f"{path}: unreadable manifest: {exc}") from None
    except RecursionError:
        raise ArtifactError(f"{path}: unreadable manifest: nested too deeply") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = json.dumps(manifest.get("format_version")) if isinstance(manifest, dict) else "?"
        raise ArtifactError(f"{path}: unsupported manifest format {found}; expected {FORMAT_VERSION}")
    for key in ("plan", "spec", "files"):
        if not isinstance(manifest.get(key), dict):
            raise ArtifactError(f"{path}: manifest has no `{key}` object")
    for rel, entry in manifest["files"].items():
        parts = rel.split("/")
        if rel.startswith("/") or "\\" in rel or any(part in ("", ".", "..") for part in parts) or rel == MANIFEST_NAME:
            raise ArtifactError(f"{path}: files lists {rel!r}, not a path inside the artifact")
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str) \
                or not _SHA256.fullmatch(digest):
            raise ArtifactError(f"{path}: files[{rel!r}] must be {{\"size\": bytes, \"sha256\": 64 hex digits}}")
    return manifest


def digest_json(value: Any) -> str:
    """The sha256 of `value` as canonical JSON: how the spec's and the plan's digests are taken."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_binding(model_dir: Path, manifest: dict[str, Any]) -> None:
    """lmc.json cannot list its own hash, so its spec and plan are bound to a file it does hash:
    serving.properties carries their digests in its header. Checks that small file's hash, then the
    digests. Raises ArtifactError when the file is altered or not listed, or when the digests disagree
    (lmc.json's plan or spec was altered)."""
    path = model_dir / MANIFEST_NAME
    entry = manifest["files"].get(BINDING_FILE)
    if entry is None:
        raise ArtifactError(f"{path}: lists no {BINDING_FILE}; not an artifact `lmc build` made, or altered")
    if sha256_file(model_dir / BINDING_FILE) != entry["sha256"]:
        raise ArtifactError(f"{model_dir / BINDING_FILE}: altered: sha256 differs from {MANIFEST_NAME}")
    header = (model_dir / BINDING_FILE).read_text(encoding="utf-8", errors="replace").splitlines()[:8]
    plan = dict(manifest["plan"], plan_sha256="")
    for name, digest in (("spec", digest_json(manifest["spec"])), ("plan", digest_json(plan))):
        if f"# {name} sha256 {digest}" not in header:
            raise ArtifactError(f"{path}: altered: its {name} does not match the {name} sha256 in {BINDING_FILE}")


def verify_artifact(model_dir: Path, check_hashes: bool = True) -> dict[str, Any]:
    """Check every file the manifest lists (size, then, with `check_hashes`, sha256) and lmc.json's
    spec and plan against serving.properties (check_binding: before anything trusts the plan).
    Returns the manifest. Raises ArtifactError naming the first missing or altered file.
    """
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    _check_listing(model_dir, manifest)
    for rel, entry in manifest["files"].items():
        path = model_dir / rel
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in {MANIFEST_NAME} but missing from the artifact")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ArtifactError(f"{path}: altered: size {size} bytes, manifest says {entry['size']}")
        if check_hashes and sha256_file(path) != entry["sha256"]:
            raise ArtifactError(f"{path}: altered: sha256 differs from {MANIFEST_NAME}")
    check_binding(model_dir, manifest)
    missing = [rel for rel in expected_files(manifest) if rel not in manifest["files"]]
    if missing:
        raise ArtifactError(f"{model_dir / MANIFEST_NAME}: lists no {', '.join(missing)}, which its plan needs; "
                            "not an artifact `lmc build` made, or altered")
    return manifest


def expected_files(manifest: dict[str, Any]) -> list[str]:
    """The files every artifact built for `manifest`'s plan has (more may be listed: tokenizer files,
    generation_config.json, Neuron graphs). A file removed together with its entry is caught here,
    before any process starts, instead of by a load that fails."""
    plan, spec = manifest["plan"], manifest["spec"]
    vllm = plan.get("engine") == "vllm"  # LMI's vLLM handler is the entry point: no model.py
    names = [BINDING_FILE, "requirements.txt"] if vllm else [BINDING_FILE, "model.py", "requirements.txt"]
    model = spec.get("model")
    if isinstance(model, dict) and model.get("uri"):  # the container loads the weights itself
        return names
    names.append("config.json")
    tp = plan.get("tensor_parallel_degree")
    if not (isinstance(tp, int) and not isinstance(tp, bool) and 0 < tp <= 1024):
        tp = None  # no rank files to expect
    stages = pipeline_degree(plan)
    quantized = vllm and (plan.get("model") or {}).get("checkpoint_quantization")
    if quantized:  # the quantized checkpoint as published: one file, or its shards and their index
        sharded = "model.safetensors.index.json" in manifest["files"]
        names.append("model.safetensors.index.json" if sharded else "model.safetensors")
    elif vllm and "model.safetensors" not in manifest["files"] and tp:
        names += [VLLM_SHARDED_STATE.format(rank=rank, part=0) for rank in range(tp)]  # each rank's first part
    elif vllm or plan.get("engine") == "neuronx":
        names.append("model.safetensors")  # the whole checkpoint, cast
    elif stages > 1:
        pass  # an artifact of lmc's removed hf pipeline: `lmc runtime` refuses it with the reason
    elif tp:
        names += [shard_path(tp, rank) for rank in range(tp)]
    return names


def _check_listing(model_dir: Path, manifest: dict[str, Any]) -> None:
    """Refuse a path the manifest does not list (the top-level __pycache__/ aside): a file added after
    the build, or one whose entry was removed, would be served unverified. Links to directories are
    followed (a shards/ moved to another volume and linked back is still checked file by file); a
    second name for a directory (a loop, an alias) is refused."""
    listed = manifest["files"]
    seen: set[Path] = set()

    def unlistable(error: OSError) -> None:  # os.walk would skip the directory, and whatever it holds
        raise ArtifactError(f"{error.filename}: cannot be listed: {error.strerror or error}")

    for root, dirs, names in os.walk(model_dir, onerror=unlistable, followlinks=True):
        here = Path(root)
        if here.resolve() in seen:  # a loop, or a second name for a directory: never a build's output
            raise ArtifactError(f"{here}: links to a directory the artifact already has")
        seen.add(here.resolve())
        dirs[:] = sorted(d for d in dirs if not (here == model_dir and d == _BYTECODE_DIR))
        for name in sorted(names):
            path = here / name
            rel = path.relative_to(model_dir).as_posix()
            if rel != MANIFEST_NAME and rel not in listed:
                raise ArtifactError(f"{path}: not listed in {MANIFEST_NAME}: added after the build, or its entry "
                                    "was removed; refusing to serve an unverified file")
