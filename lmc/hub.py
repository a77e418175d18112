"""A Hugging Face Hub id's config.json and safetensors metadata, through huggingface_hub (never
hand-written HTTP): the Hub and HF-cache sources of lmc/model_sources.py, and `lmc build`'s download.

`lmc plan` needs only what planning needs: the commit a revision points at (from downloading `config.json` into the HF cache), `config.json` (and,
best effort, `generation_config.json` and `tokenizer_config.json`, which the build uses) through the
HF cache, and the safetensors metadata (`get_safetensors_metadata`: a few KB of headers by range
request) for exact tensor names, dtypes and shapes. The user's Hugging Face setup is honoured as
huggingface_hub reads it: HF_TOKEN (gated repos), HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT.

The safetensors metadata is not in the HF cache, so lmc keeps its own summary per commit under
`$HF_HOME/lmc/safetensors/<org>--<name>/<commit>.json`: a second plan of the same commit, online or
offline, reads no header again. Offline with a cached config.json but no summary, the weights are
computed from the config and the facts say so.

Every failure is one line (a SpecValueError on `model.id` or `model.revision`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.errors import SpecValueError
from lmc.planner.checkpoint_facts import Answer, Tensor, Weights

# What planning reads besides the weights' metadata; only config.json must exist.
PLAN_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")


class HubUnavailable(SpecValueError):
    """The Hub could not answer (no network, offline with nothing cached, a gated repo without a
    token): for an id the built-in catalog holds, planning goes on from the catalog."""


@dataclass(frozen=True)
class HubCheckpoint:
    """A Hub revision as planning saw it: the commit, the config, the tensors per safetensors file."""

    model_id: str
    commit: str
    config: dict[str, Any]
    files: dict[str, list[Tensor]] | None  # file -> its tensors; None: unknown (offline, no summary kept)


def hub_answer(model_id: str, revision: str | None, *, offline: bool) -> Answer:
    """`model_id` at `revision` (default: main) as a source's answer (lmc/model_sources.py): from the Hub,
    or `offline` from the HF cache."""
    from huggingface_hub import constants

    checkpoint = resolve(model_id, revision, offline=offline)
    return Answer(model_id=model_id, config=checkpoint.config,
                  config_file=f"{constants.ENDPOINT}/{model_id}/blob/{checkpoint.commit}/config.json",
                  source=f"Hub {model_id}@{checkpoint.commit}", weights=lambda: _hub_weights(checkpoint.files),
                  stated={"revision": checkpoint.commit})


def _hub_weights(files: dict[str, list[Tensor]] | None) -> Weights:
    if files is None:
        return Weights(None, " (HF_HUB_OFFLINE: config.json from the HF cache; no safetensors metadata cached, so "
                             "the weights are computed from the config)")
    tensors = [entry for entries in files.values() for entry in entries]
    if not tensors:  # pickle *.bin weights only: planned from the config, as a local checkpoint of them is
        return Weights(None, " (no safetensors weights in the repo: parameters computed from config.json; lmc "
                             "build needs --allow-pickle for its *.bin files)")
    return Weights(tensors, f" (config.json and the safetensors metadata of {len(files)} file(s))")


def resolve(model_id: str, revision: str | None, *, offline: bool) -> HubCheckpoint:
    """The commit, config and tensor metadata of `model_id` at `revision`, online or from the HF cache;
    one-line errors."""
    with _errors(model_id, revision):
        commit, config_path = (_cached_config(model_id, revision) if offline else _online_config(model_id, revision))
    config = _read_json(config_path, model_id)
    files = _cached_summary(model_id, commit)
    if files is None and not offline:
        with _errors(model_id, revision):
            files = _safetensors_summary(model_id, commit)
        _store_summary(model_id, commit, files)
    return HubCheckpoint(model_id=model_id, commit=commit, config=config, files=files)


# What `lmc build` downloads of a Hub repo: the weights (safetensors, pickle only when allowed), the
# config, generation config, tokenizer and chat template; never optimizer states, READMEs, other formats.
DOWNLOAD_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                     "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                     "preprocessor_config.json")
PICKLE_PATTERNS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


def download_checkpoint(model_id: str, commit: str, *, allow_pickle: bool = False) -> Path:
    """The checkpoint at `commit` in the HF cache (downloaded as needed: resumable, with huggingface_hub's
    progress bars), every safetensors file checked against the metadata the plan read."""
    import sys

    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    if not sys.stderr.isatty():  # bars for a person watching; logs and pipes get the one line
        disable_progress_bars()
    patterns = list(DOWNLOAD_PATTERNS) + (list(PICKLE_PATTERNS) if allow_pickle else [])
    with _errors(model_id, commit):
        folder = Path(snapshot_download(model_id, revision=commit, allow_patterns=patterns))
    if folder.name != commit:
        raise SpecValueError("model.revision", commit, f"the Hub served {model_id} at {folder.name}, not the "
                                                       f"commit {commit} the plan read; plan again")
    expected = _cached_summary(model_id, commit)
    if expected is not None:
        check_against_summary(folder, expected)
    return folder


def check_against_summary(folder: Path, expected: dict[str, list[Tensor]]) -> None:
    """Every safetensors file the plan read the headers of is there with the same tensors (names, dtypes,
    shapes), and no other: a one-line CheckpointError naming the first difference."""
    from lmc.errors import CheckpointError
    from lmc.planner.checkpoint_facts import read_safetensors_header

    present = sorted(path.name for path in folder.glob("*.safetensors"))
    if present != sorted(expected):
        missing, extra = sorted(set(expected) - set(present)), sorted(set(present) - set(expected))
        raise CheckpointError(f"{folder}: the downloaded weights are not the files the plan read "
                              + (f"(missing {missing[0]})" if missing else f"(unexpected {extra[0]})"))
    for name in present:
        got = sorted((tensor, dtype, tuple(shape)) for tensor, dtype, shape in read_safetensors_header(folder / name))
        if got != sorted(expected[name]):
            differ = next((g, e) for g, e in zip(got + [None], sorted(expected[name]) + [None]) if g != e)
            raise CheckpointError(f"{folder / name}: differs from the safetensors metadata the plan read "
                                  f"(downloaded {differ[0]}, planned {differ[1]})")


def summary_path(model_id: str, commit: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "lmc" / "safetensors" / model_id.replace("/", "--") / f"{commit}.json"


def _online_config(model_id: str, revision: str | None) -> tuple[str, str]:
    """config.json at `revision` (main by default) through the HF cache: the snapshot folder it lands in
    is the commit the revision points at (huggingface_hub records the branch's ref too, so an offline
    plan of the same revision finds it)."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    # model_info first: it fails at once when the Hub cannot be reached (hf_hub_download retries for
    # ~20 s), and names an unknown repo or revision.
    HfApi().model_info(model_id, revision=revision)
    commit, config_path = _commit_of(hf_hub_download(model_id, "config.json", revision=revision))
    for name in PLAN_FILES[1:]:  # best effort: not every repo has them
        try:
            hf_hub_download(model_id, name, revision=commit)
        except EntryNotFoundError:
            pass
    return commit, config_path


def _commit_of(path: str) -> tuple[str, str]:
    return Path(path).parent.name, path


def _cached_config(model_id: str, revision: str | None) -> tuple[str, str]:
    """Offline: config.json from the HF cache; the commit is the snapshot folder it lies in."""
    from huggingface_hub import hf_hub_download

    return _commit_of(hf_hub_download(model_id, "config.json", revision=revision))


def _safetensors_summary(model_id: str, commit: str) -> dict[str, list[Tensor]]:
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import EntryNotFoundError, NotASafetensorsRepoError, SafetensorsParsingError
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = are_progress_bars_disabled()
    disable_progress_bars()  # its "Parse safetensors files" bar over a sharded repo's few-KB header reads
    try:
        metadata = get_safetensors_metadata(model_id, revision=commit)
    except NotASafetensorsRepoError:
        return {}
    except EntryNotFoundError as exc:  # a shard the index names is not in the repo
        raise SpecValueError("model.id", model_id, f"model.safetensors.index.json at {commit} names a file the repo "
                                                   f"does not have, a corrupt checkpoint ({_one_line(exc)})") from None
    except (SafetensorsParsingError, ValueError, TypeError, AttributeError, KeyError) as exc:
        # huggingface_hub parses the repo's headers (and index) as it finds them: a corrupt one raises its
        # SafetensorsParsingError, or a JSON or type error of its own parsing code.
        raise SpecValueError("model.id", model_id, f"the Hub repo's safetensors headers at {commit} cannot be read, "
                                                   f"a corrupt checkpoint ({_one_line(exc)})") from None
    finally:
        if not quiet:  # as the caller had them (lmc build's download shows them to a person at a terminal)
            enable_progress_bars()
    return {name: sorted((tensor, info.dtype, tuple(info.shape)) for tensor, info in file.tensors.items())
            for name, file in sorted(metadata.files_metadata.items())}


def _cached_summary(model_id: str, commit: str) -> dict[str, list[Tensor]] | None:
    path = summary_path(model_id, commit)
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        return {name: [(t[0], t[1], tuple(t[2])) for t in tensors] for name, tensors in body["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None  # absent or damaged: read the headers again


def _store_summary(model_id: str, commit: str, files: dict) -> None:
    """Write the summary atomically (a crash leaves the old one or none, never half of one)."""
    path = summary_path(model_id, commit)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        body = {"model_id": model_id, "commit": commit,
                "files": {name: [[t[0], t[1], list(t[2])] for t in tensors] for name, tensors in files.items()}}
        temporary.write_text(json.dumps(body, separators=(",", ":")), encoding="utf-8")
        os.replace(temporary, path)
    except OSError:
        pass  # a read-only HF_HOME only costs the next plan the header reads


def _read_json(path: str, model_id: str) -> dict[str, Any]:
    try:
        body = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecValueError("model.id", model_id, f"config.json in the HF cache ({path}) is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SpecValueError("model.id", model_id, f"config.json in the HF cache ({path}) is not a JSON object")
    return body


class _errors:
    """Turns huggingface_hub's exceptions into one line that says what to do."""

    def __init__(self, model_id: str, revision: str | None):
        self.model_id, self.revision = model_id, revision

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or isinstance(exc, SpecValueError):
            return False
        from huggingface_hub import constants
        from huggingface_hub import errors

        endpoint, model_id = constants.ENDPOINT, self.model_id
        if isinstance(exc, errors.GatedRepoError):
            raise HubUnavailable("model.id", model_id, f"a gated repo: accept its terms at {endpoint}/{model_id} and "
                                                       "set HF_TOKEN to a token of that account") from None
        if isinstance(exc, errors.RevisionNotFoundError):
            raise SpecValueError("model.revision", self.revision, f"no such revision of {model_id} on the Hub "
                                                                  "(a branch, tag or commit)") from None
        if isinstance(exc, errors.RepositoryNotFoundError):
            raise SpecValueError("model.id", model_id, f"no such model on the Hub ({endpoint}), or it is private: "
                                                       "check the id, set HF_TOKEN, or give model.path") from None
        if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)) and constants.HF_HUB_OFFLINE:
            raise HubUnavailable("model.id", model_id, f"HF_HUB_OFFLINE is set and the HF cache "
                                                       f"({constants.HF_HUB_CACHE}) has no config.json for it"
                                 + (f" at {self.revision}" if self.revision else "")
                                 + "; plan once online, or give model.path") from None
        if isinstance(exc, errors.RemoteEntryNotFoundError):
            raise SpecValueError("model.id", model_id, "the Hub repo has no config.json (not a transformers "
                                                       "model)") from None
        if isinstance(exc, (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, ConnectionError)) or _is_network(exc):
            raise HubUnavailable("model.id", model_id, f"cannot reach the Hub at {endpoint} ({_one_line(exc)}); "
                                                       "check the network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to "
                                                       "plan from the HF cache") from None
        return False


def _is_network(exc: BaseException) -> bool:
    """A transport failure of huggingface_hub's HTTP client (httpx, or httpx2 in huggingface_hub 2.x),
    which it raises unwrapped when the Hub cannot be reached."""
    return type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
