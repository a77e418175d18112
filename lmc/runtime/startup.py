"""What `lmc runtime` does before serving: find the artifact, extract it safely, verify it, read
what the front end needs from it (the plan, the tokenizer, the chat template).

The runtime must not import the emitters, so this has its own small, strict tar extractor.
"""

from __future__ import annotations

import json
import logging
import lzma
import os
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from lmc.errors import ArtifactError, MissingDependencyError, UsageError
from lmc.layouts import pipeline_degree, shard_path
from lmc.manifest import MANIFEST_NAME, TOKENIZER_MODELS, sha256_file, verify_artifact

log = logging.getLogger("lmc.runtime")

DEFAULT_MODEL_DIR = Path("/opt/ml/model")
DEFAULT_PORT = 8080
_COPY_CHUNK = 8 * 1024 * 1024
_PLAN_KEYS = ("engine", "tensor_parallel_degree", "replicas", "batch_size", "max_batch_delay_ms",
              "job_queue_size", "max_sequence_length")


def resolve_port(flag: int | None, environ: dict[str, str] | None = None) -> int:
    """--port (0-65535; 0: a free port the system picks), else SAGEMAKER_BIND_TO_PORT, else 8080."""
    environ = os.environ if environ is None else environ
    if flag is not None:
        if not 0 <= flag <= 65535:
            raise UsageError(f"--port = {flag}: not a TCP port number (0-65535; 0: any free port)")
        return flag
    value = environ.get("SAGEMAKER_BIND_TO_PORT")
    if value:
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise ArtifactError(f"SAGEMAKER_BIND_TO_PORT = {value!r}: not a TCP port number")
        return int(value)
    return DEFAULT_PORT


_MAX_MEMBER_DEPTH = 32


def _unsafe_reason(member: tarfile.TarInfo) -> str | None:
    name = PurePosixPath(member.name)
    if not member.name or "\\" in member.name or "\0" in member.name:
        return "empty or non-POSIX path"
    if name.is_absolute() or member.name.startswith("/"):
        return "absolute path"
    if ".." in name.parts:
        return "path escapes the archive ('..')"
    if len(name.parts) > _MAX_MEMBER_DEPTH:  # lmc's artifacts go 3 deep (shards/tpN/rankR.safetensors)
        return f"path more than {_MAX_MEMBER_DEPTH} directories deep"
    if member.issym() or member.islnk():
        return "links are not allowed"
    if not (member.isfile() or member.isdir()):
        return "only regular files and directories are allowed"
    return None


def extract_archive(archive: Path, dest: Path) -> Path:
    """Extract `archive` into `dest`, refusing absolute paths, `..`, links and devices.

    Members are copied by hand (not `extractall`) so no mode, owner or time from the archive applies.
    """
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            for member in members:
                reason = _unsafe_reason(member)
                if reason:
                    raise ArtifactError(f"{archive}: member {member.name!r}: {reason}; refusing to extract")
            for member in members:
                target = dest / member.name
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                with source, open(target, "wb") as out:
                    shutil.copyfileobj(source, out, _COPY_CHUNK)
            # Read the stream to its end: gzip checks its CRC and length only there. And tarfile stops at
            # the first header it cannot read as if the archive ended there: past that point (tar.offset)
            # only the end-of-archive zero blocks may follow, or the archive lost members (lmc.json
            # would be reported "missing" instead) or carries data nothing extracts.
            tar.fileobj.seek(tar.offset)  # forward: extraction stopped at or before it
            while chunk := tar.fileobj.read(_COPY_CHUNK):
                if chunk.count(0) != len(chunk):
                    raise ArtifactError(f"{archive}: corrupt tar archive: unreadable data after member "
                                        f"{members[-1].name if members else '(none)'!r}; refusing it")
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
        raise ArtifactError(f"{archive}: not a readable tar archive: {' '.join(str(exc).split())}") from None
    return dest


@dataclass
class Artifact:
    """A verified artifact on disk and the parts of its manifest the runtime uses."""

    model_dir: Path
    manifest: dict[str, Any]
    plan: dict[str, Any]
    temp_dir: Path | None = None  # set when we extracted an archive; removed by cleanup()

    def cleanup(self) -> None:
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def verify_hashes(model_dir: Path, manifest: dict[str, Any], threads: int | None = None) -> None:
    """Check every listed file's sha256, several files at once (hashlib releases the GIL, and the
    per-rank shards are separate files). Raises ArtifactError naming the first altered file in
    manifest order, whatever order the hashes finish in.

    By default one core is left to the fork server, whose imports run at the same time and are
    the longer of the two on small hosts (1 GB hashes in about a second per core)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    entries = list(manifest["files"].items())
    threads = threads or min(8, max(1, (os.cpu_count() or 1) - 1))
    # Largest first, so one big shard does not start last and finish alone.
    order = sorted(entries, key=lambda item: -int(item[1]["size"]))
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmc-verify")
    try:
        futures = [pool.submit(sha256_file, model_dir / rel, stop) for rel, _ in order]
        digests = {rel: future.result() for (rel, _), future in zip(order, futures)}
    finally:
        # Interrupted (SIGTERM during start-up): the hashes still running stop at their next chunk, the
        # others never start, and the process need not wait for gigabytes it will not use.
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    for rel, entry in entries:
        if digests[rel] != entry["sha256"]:
            raise ArtifactError(f"{model_dir / rel}: altered: sha256 differs from {MANIFEST_NAME}")


def verify_for_rank(model_dir: Path, rank: int, world_size: int) -> dict[str, Any]:
    """What a rank that loads the artifact with no lmc front end before it (DJL Serving's MPI mode)
    checks first: every file listed and no other (verify_artifact), then the sha256 of every file but
    the other ranks' shards, which it never opens. Returns the manifest; raises ArtifactError naming
    the first bad file."""
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (rank, world_size)) or not 0 <= rank < world_size:
        raise ArtifactError(f"rank {rank!r} of world size {world_size!r}: not a rank of that world")
    manifest = verify_artifact(model_dir, check_hashes=False)
    stages = pipeline_degree(manifest["plan"])
    if stages > 1:
        raise ArtifactError(f"{model_dir}: planned for {stages} instances (pipeline parallel degree {stages}) on lmc's "
                            "own hf pipeline, which was removed: plan and build the spec again (vLLM runs models "
                            "across instances)")
    tp = manifest["plan"].get("tensor_parallel_degree")
    others = {shard_path(tp, other) for other in range(tp) if other != rank} if world_size > 1 and isinstance(tp, int) else set()
    verify_hashes(model_dir, dict(manifest, files={rel: entry for rel, entry in manifest["files"].items() if rel not in others}),
                  threads=min(8, os.cpu_count() or 1))
    return manifest


def open_artifact(path: Path | None, check_hashes: bool = True) -> Artifact:
    """Resolve a model dir or archive (default /opt/ml/model), extract it if needed, verify every
    file's size and (unless `check_hashes` is False: the caller runs `verify_hashes` itself, in
    parallel with worker warm-up) sha256 against lmc.json. Raises ArtifactError naming the first
    bad file."""
    path = Path(path) if path is not None else DEFAULT_MODEL_DIR
    temp_dir = None
    if path.is_file():
        temp_dir = Path(tempfile.mkdtemp(prefix="lmc-model-", dir=os.environ.get("LMC_EXTRACT_DIR")))
        try:
            extract_archive(path, temp_dir)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        model_dir = temp_dir
    elif path.is_dir():
        model_dir = path
    else:
        raise ArtifactError(f"{path}: no such model directory or archive")
    try:
        # Presence, sizes and the plan's binding (it decides what starts): cheap, before anything starts.
        manifest = verify_artifact(model_dir, check_hashes=False)
        if check_hashes:
            verify_hashes(model_dir, manifest)
        plan = manifest["plan"]
        missing = [key for key in _PLAN_KEYS if key not in plan]
        if missing:
            raise ArtifactError(f"{model_dir / 'lmc.json'}: plan lacks {', '.join(missing)}")
    except BaseException:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return Artifact(model_dir=model_dir, manifest=manifest, plan=plan, temp_dir=temp_dir)


def default_request_timeout_s(plan: dict[str, Any]) -> float:
    """Generous: ten times the predicted time of a full-length generation, at least 60 s."""
    predicted = plan.get("predicted") or {}
    ttft = float(predicted.get("ttft_ms") or 0.0)
    tpot = float(predicted.get("tpot_ms") or 0.0)
    if ttft <= 0 and tpot <= 0:
        return 120.0
    return max(60.0, 10.0 * (ttft + tpot * int(plan["max_sequence_length"])) / 1000.0)


# What the OpenAI routes take from the model's generation_config.json when a request leaves them out:
# the fields vLLM's OpenAI server takes (its default `--generation-config auto`) that lmc supports.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")


def planned_output_tokens(model_dir: Path) -> int | None:
    """The spec's workload.max_output_tokens as the manifest records it (None when it does not)."""
    workload = (_read_json(model_dir / MANIFEST_NAME).get("spec") or {}).get("workload") or {}
    value = workload.get("max_output_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The model publisher's sampling defaults from `generation_config.json`, for the OpenAI routes.

    Like vLLM, only the values the file sets are taken (no transformers defaults such as top_k 50), and
    `do_sample` is not read: an OpenAI request samples unless its temperature is 0. A value the request
    parser would refuse is left out with a warning, so a bad file cannot fail every request."""
    from lmc.runtime.requests import parse_parameters

    config = _read_json(model_dir / "generation_config.json")
    defaults: dict[str, Any] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = config.get(key)
        if value is None:
            continue
        try:
            parse_parameters({key: value})
        except ValueError as exc:
            log.warning("generation_config.json: ignoring %s = %r (%s)", key, value, exc)
            continue
        defaults[key] = value
    return defaults


# Prompts longer than this (characters, all of a request's together) are tokenized on a thread, by the
# front end (core.Runtime.count_prompts) and the vLLM backend alike; shorter ones in place.
INLINE_TOKENIZE_CHARS = 4096


class TextTools:
    """Prompt token counting and chat templating in the front end, from the artifact's tokenizer
    (see load_tokenizer) and jinja2. An artifact without a tokenizer is refused (ArtifactError)."""

    def __init__(self, model_dir: Path):
        self._tokenizer = load_tokenizer(model_dir)
        self._anchor: tuple[list[int], str] | None = None
        config = _read_json(model_dir / "tokenizer_config.json")
        # The special tokens a template may write, as transformers 5 resolves them: a tokenizer_config.json
        # with added_tokens_decoder (saved by transformers >= 4.34) is the whole story; before that,
        # special_tokens_map.json's entries win over the config's. Absent ones stay undefined.
        legacy = {} if "added_tokens_decoder" in config else _read_json(model_dir / "special_tokens_map.json")
        self._special = {}
        for key in _SPECIAL_TOKENS:
            text = _token_text(legacy.get(key)) or _token_text(config.get(key))
            if text:
                self._special[key] = text
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if not template and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        self._template = None
        if isinstance(template, str) and template:
            self._template = _compile_template(template)

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads after other text (special tokens included), for logprobs. Decoded
        behind an anchor token: decoders that strip the first leading space (SentencePiece's) would turn
        '▁world' alone into 'world'."""
        if self._anchor is None:
            ids = self._tokenizer.encode("a", add_special_tokens=False).ids
            self._anchor = (ids[-1:], self._tokenizer.decode(ids[-1:], skip_special_tokens=False))
        anchor_ids, anchor_text = self._anchor
        text = self._tokenizer.decode(anchor_ids + [token_id], skip_special_tokens=False)
        if anchor_ids and text.startswith(anchor_text):
            return text[len(anchor_text):]
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def count_tokens(self, texts: list[str], add_special_tokens: bool = True) -> list[int]:
        """Each text's token count. The tokenizer's batch call lets go of the GIL while it works (its
        single-text call does not): run from a thread, a long prompt leaves the event loop free."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [len(encoding.ids) for encoding in encodings]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text` (what count_tokens counts), for engines that take ids (vLLM)."""
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The prompt for a chat: the model's template with add_generation_prompt. Raises ValueError."""
        if self._template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json chat_template); use /v1/completions")
        try:
            return self._template.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                         **self._special)
        except Exception as exc:  # the template's own raise_exception(), or bad message shapes
            raise ValueError(f"chat template rejected the messages: {exc}") from None


def load_tokenizer(model_dir: Path):
    """The artifact's tokenizer as a `tokenizers.Tokenizer`: tokenizer.json read directly (no transformers
    import: start-up stays fast), else the fast tokenizer transformers' AutoTokenizer makes of the other
    files lmc build accepts (tokenizer.model, spiece.model, vocab.json + merges.txt, vocab.txt). Prompts
    are counted with it: the maximum-sequence-length check and usage.prompt_tokens. ArtifactError, one
    line, when the artifact has none or transformers cannot read it."""
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tokenizer_file))
    if not any(all((model_dir / name).is_file() for name in group) for group in TOKENIZER_MODELS):
        expected = ", ".join(" + ".join(group) for group in TOKENIZER_MODELS)
        raise ArtifactError(f"{model_dir}: no tokenizer files (expected one of {expected}): the runtime counts "
                            "prompt tokens with the model's tokenizer; build the artifact from a checkpoint that has one")
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(f"{model_dir}: its tokenizer has no tokenizer.json, and reading the others needs "
                                     "transformers: pip install 'lmc[engines]'") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # the library's own errors: a missing sentencepiece, an unreadable file
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise ArtifactError(f"{model_dir}: transformers cannot read its tokenizer: {type(exc).__name__}: {reason}") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ArtifactError(f"{model_dir}: transformers reads its tokenizer only as a Python {type(tokenizer).__name__}; "
                            "save it with save_pretrained to add a tokenizer.json, and build again")
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken serialized as {"content": ...}
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _compile_template(source: str):
    """The template in an environment like transformers' apply_chat_template builds, so hub templates
    render the same: its settings, `raise_exception`, `strftime_now` (Llama 3.1+ templates date their
    system prompt with it), `dict`, and its `tojson` (not HTML-escaping; ensure_ascii, indent,
    separators and sort_keys as json.dumps)."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)  # not the type: no attributes to reach
    env.filters["tojson"] = tojson
    return env.from_string(source)
