"""Packing what a plan serves beside the base weights: each adapter's files in adapters/<name>/ and the
speculative proposer's checkpoint in draft/ (layout: lmc.served_artifact). Files are copied byte for byte;
lmc.json then lists them with their sha256 like every other file, and `lmc runtime` verifies them before
vLLM starts. Hub adapters and drafts come through huggingface_hub at the commit the plan read."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from lmc.errors import SpecValueError
from lmc.planner.plan import LoraAdapter, Plan, SpeculativeSection
from lmc.schema import LoadedSpec
from lmc.served_artifact import ADAPTER_FILES, ADAPTERS_DIR, DRAFT_DIR

# A proposer's files: its config, weights and tokenizer (what vLLM loads for a draft or an EAGLE-3 head).
DRAFT_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def stage_served(loaded: LoadedSpec, plan: Plan, staging: Path, say: Callable[[str], None]) -> None:
    """Copy the plan's adapters and draft into `staging`. Raises SpecValueError on the spec's key."""
    for index, adapter in enumerate(plan.lora.adapters if plan.lora else []):
        source = _adapter_source(loaded, index, adapter)
        say(f"packing adapter {adapter.name} from {source}")
        _check_adapter_weights(source, adapter, _key(loaded, index))
        target = staging / ADAPTERS_DIR / adapter.name
        target.mkdir(parents=True)
        for name in ADAPTER_FILES:
            shutil.copyfile(source / name, target / name)
    speculative = plan.speculative
    if speculative is not None and speculative.enabled and speculative.model is not None:
        source = _draft_source(loaded, speculative)
        say(f"packing the {speculative.method} proposer from {source}")
        target = staging / DRAFT_DIR
        target.mkdir()
        for file in sorted({f for pattern in DRAFT_PATTERNS for f in source.glob(pattern) if f.is_file()}):
            shutil.copyfile(file, target / file.name)


def _key(loaded: LoadedSpec, index: int) -> str:
    from lmc.served_facts import adapter_key

    return adapter_key(loaded.spec, index)


def _adapter_source(loaded: LoadedSpec, index: int, adapter: LoraAdapter) -> Path:
    spec_adapter = loaded.spec.adapters[index]
    if spec_adapter.path is not None:
        return loaded.source.resolve(spec_adapter.path)
    from lmc.served_facts import download_adapter

    return download_adapter(spec_adapter.id, adapter.revision)


def _check_adapter_weights(folder: Path, adapter: LoraAdapter, key: str) -> None:
    """The weights vLLM loads are there, and their LoRA matrices have the rank the plan read."""
    from lmc.safetensors_header import HeaderError, read_header

    weights = folder / ADAPTER_FILES[1]
    if not weights.is_file():
        raise SpecValueError(key, str(folder), f"no {weights.name} in it: vLLM loads the adapter's weights from "
                                               "that file (save the adapter with safe_serialization)")
    try:
        tensors = read_header(weights).tensors
    except (HeaderError, OSError) as exc:
        raise SpecValueError(key, str(folder), f"{weights}: not a readable safetensors file ({exc})") from None
    ranks = {entry.shape[0] for name, entry in tensors.items() if "lora_A" in name and entry.shape}
    if not ranks or ranks != {adapter.rank}:
        raise SpecValueError(key, str(folder), f"{weights.name}: lora_A ranks {sorted(ranks)} do not match "
                                               f"adapter_config.json's r = {adapter.rank}")


def _draft_source(loaded: LoadedSpec, speculative: SpeculativeSection) -> Path:
    from lmc.served_facts import draft_dir

    local = draft_dir(loaded)
    if local is not None:
        return local
    if speculative.revision is None:
        raise SpecValueError("speculative.model", speculative.model, "its facts came from lmc's catalog, which "
                                                                        "holds no weights: give a path, or let lmc "
                                                                        "download it from the Hub")
    from lmc.hub import download_checkpoint

    return download_checkpoint(speculative.model, speculative.revision)
