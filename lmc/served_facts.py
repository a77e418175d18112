"""Facts of what a spec serves beside the base model, gathered at the edge (lmc.pipeline) before planning:
each adapter's adapter_config.json and safetensors header (a PEFT directory, or a Hub repo through
huggingface_hub: only adapter_config.json is read to plan), and the speculative proposer's config (a draft
model or EAGLE-3 head: a path, the Hub, or the catalog). One-line SpecValueErrors on the spec's keys.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lmc.errors import CheckpointError, SpecValueError, short_repr
from lmc.planner.facts import AdapterFacts, ModelFacts, SpeculativeFacts
from lmc.schema import LoadedSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What `lmc build` downloads of a Hub adapter: its config and weights, nothing else.
ADAPTER_PATTERNS = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


def adapter_key(spec, index: int) -> str:
    adapter = spec.adapters[index]
    return f"adapters.{index}.{'path' if adapter.path is not None else 'id'}"


def with_served_facts(loaded: LoadedSpec, model: ModelFacts, checkpoint: Path | None) -> ModelFacts:
    """`model` with the spec's adapters and speculative proposer read, checked against it."""
    from lmc.planner.lora import check_adapters
    from lmc.planner.speculative import check_speculative

    spec = loaded.spec
    if not spec.adapters and spec.speculative is None:
        return model
    adapters = tuple(adapter_facts(loaded, index, model) for index in range(len(spec.adapters)))
    model = model.model_copy(update={"adapters": adapters,
                                     "speculative": speculative_facts(loaded, model, checkpoint)})
    check_adapters(model, [(adapter_key(spec, index), a.path if a.path is not None else a.id)
                           for index, a in enumerate(spec.adapters)])
    check_speculative(model)
    return model


def adapter_dir(loaded: LoadedSpec, index: int) -> tuple[Path, str | None]:
    """The directory holding adapter `index`'s files, and the Hub commit read (None for a path)."""
    adapter = loaded.spec.adapters[index]
    key = adapter_key(loaded.spec, index)
    if adapter.path is not None:
        path = loaded.source.resolve(adapter.path)
        if not (path / ADAPTER_CONFIG).is_file():
            raise SpecValueError(key, adapter.path, f"no {ADAPTER_CONFIG} in {path} (a PEFT LoRA directory)")
        return path, None
    config = _hub_file(key, adapter.id, adapter.revision, ADAPTER_CONFIG)
    return config.parent, config.parent.name


def adapter_facts(loaded: LoadedSpec, index: int, model: ModelFacts) -> AdapterFacts:
    adapter = loaded.spec.adapters[index]
    key = adapter_key(loaded.spec, index)
    folder, commit = adapter_dir(loaded, index)
    shown = adapter.path if adapter.path is not None else adapter.id
    config = _read_json(folder / ADAPTER_CONFIG, key, shown)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise SpecValueError(key, shown, f"{ADAPTER_CONFIG} has peft_type {config.get('peft_type')!r}; vLLM serves "
                                         "LoRA adapters only")
    rank = config.get("r")
    modules = config.get("target_modules")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise SpecValueError(key, shown, f"{ADAPTER_CONFIG}: `r` (the LoRA rank) must be a positive integer, not "
                                         f"{short_repr(rank, 60)}")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise SpecValueError(key, shown, f"{ADAPTER_CONFIG}: `target_modules` must list module names (a regular "
                                         f"expression is not served by vLLM), not {short_repr(modules, 60)}")
    alpha = config.get("lora_alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not 0 <= alpha < float("inf")):
        raise SpecValueError(key, shown, f"{ADAPTER_CONFIG}: `lora_alpha` must be a non-negative number, not "
                                         f"{short_repr(alpha, 60)}")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise SpecValueError(key, shown, f"{ADAPTER_CONFIG}: `base_model_name_or_path` must be a model id or path, not "
                                         f"{short_repr(base, 60)}")
    weights = folder / ADAPTER_WEIGHTS
    if weights.is_file():
        weight_bytes = _weight_bytes(weights, key, shown)
    else:  # a Hub adapter is planned from its config: rank × the adapted modules' widths, 16-bit
        from lmc.planner.lora import module_widths, named_modules

        widths = module_widths(model)
        weight_bytes = sum(rank * sum(widths.get(m, (0, 0))) for m in named_modules(tuple(modules))) * 2 * model.layers
    source = adapter.path if commit is None else f"{adapter.id}@{commit}"
    return AdapterFacts(name=adapter.name, source=source, revision=commit, rank=rank,
                        alpha=float(alpha or 0), target_modules=tuple(sorted(modules)), base_model=base or None,
                        weight_bytes=weight_bytes)


def speculative_facts(loaded: LoadedSpec, model: ModelFacts, checkpoint: Path | None) -> SpeculativeFacts | None:
    from lmc.planner.speculative import acceptance

    spec = loaded.spec.speculative
    if spec is None:
        return None
    rate, source = acceptance(spec.method, spec.acceptance_rate)
    draft = None
    if spec.model is not None:
        draft = draft_facts(loaded, spec.model, checkpoint)
    return SpeculativeFacts(method=spec.method, num_tokens=spec.num_tokens, acceptance_rate=rate,
                            acceptance_source=source, draft=draft, draft_source=spec.model)


def draft_dir(loaded: LoadedSpec) -> Path | None:
    """The draft model's or head's local directory, when `speculative.model` names one."""
    spec = loaded.spec.speculative
    if spec is None or spec.model is None:
        return None
    path = loaded.source.resolve(spec.model)
    return path if path.is_dir() else None


def draft_facts(loaded: LoadedSpec, name: str, checkpoint: Path | None) -> ModelFacts:
    """The proposer's facts: from a directory when `name` is one (relative to the spec), else the Hub, else
    the catalog (lmc/model_sources.py); a draft beside a local base must have the base's tokenizer files."""
    from lmc.model_sources import Wanted, read_model_facts

    path = draft_dir(loaded)
    try:
        if path is not None:
            _check_same_tokenizer(checkpoint, path, name)
        return read_model_facts(Wanted(name, None, path))
    except CheckpointError as exc:
        raise SpecValueError("speculative.model", name, str(exc)) from None
    except SpecValueError as exc:
        raise SpecValueError("speculative.model", name, exc.detail) from None


def _check_same_tokenizer(base: Path | None, draft: Path, name: str) -> None:
    if base is None:
        return
    for file in ("tokenizer.json", "tokenizer.model"):
        if (base / file).is_file() and (draft / file).is_file():
            if _sha256(base / file) != _sha256(draft / file):
                raise SpecValueError("speculative.model", name, f"its {file} differs from the base's: a proposer "
                                                                "needs the base's tokenizer")
            return


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _weight_bytes(path: Path, key: str, shown: str) -> int:
    from lmc.safetensors_header import HeaderError, read_header

    try:
        header = read_header(path)
    except (HeaderError, OSError) as exc:
        raise SpecValueError(key, shown, f"{path}: not a readable safetensors file ({exc})") from None
    return sum(entry.nbytes for entry in header.tensors.values())


def _read_json(path: Path, key: str, shown: str) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecValueError(key, shown, f"{path} is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise SpecValueError(key, shown, f"{path} is not a JSON object")
    return body


def _hub_file(key: str, repo: str, revision: str | None, filename: str) -> Path:
    """`filename` of a Hub repo through the HF cache (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE honoured)."""
    from huggingface_hub import constants, errors, hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename, revision=revision))
    except errors.RevisionNotFoundError:
        raise SpecValueError(key, repo, f"no revision {revision!r} of it on the Hub ({constants.ENDPOINT})") from None
    except errors.RepositoryNotFoundError:
        raise SpecValueError(key, repo, f"no such repo on the Hub ({constants.ENDPOINT}), or it is private: check "
                                        "the id, or set HF_TOKEN") from None
    except errors.RemoteEntryNotFoundError:
        raise SpecValueError(key, repo, f"the repo has no {filename}: not a PEFT adapter") from None
    except Exception as exc:  # no network, offline without the file cached, ...: one line
        from lmc.hub import _one_line

        offline = " (HF_HUB_OFFLINE: not in the HF cache)" if constants.HF_HUB_OFFLINE else ""
        raise SpecValueError(key, repo, f"cannot read {filename} from the Hub at {constants.ENDPOINT}{offline} "
                                        f"({_one_line(exc)})") from None


def download_adapter(repo: str, commit: str) -> Path:
    """A Hub adapter's files at `commit` in the HF cache: its config and weights only."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, revision=commit, allow_patterns=list(ADAPTER_PATTERNS)))
