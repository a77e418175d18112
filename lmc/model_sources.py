"""Where a model's facts come from: one ordered chain of sources, read once per model per plan.

1. `local_checkpoint`: `model.path` (a draft's directory): its config.json and safetensors headers.
2. `hub`: the Hub through huggingface_hub (HF_ENDPOINT, HF_TOKEN): config.json into the HF cache and
   the safetensors metadata (lmc/hub.py).
3. `hf_cache`: under HF_HUB_OFFLINE, config.json from the HF cache and the metadata lmc kept per commit.
4. `built_in_catalog`: the built-in published config.json files, for an id the catalog holds and no
   pinned revision.

Each source answers alike: an `Answer` (planner/checkpoint_facts.py: the config dict, the tensors,
where they came from), or `Unavailable` (why; and the error to show when no later source answers).
An error in a source's answer (a broken checkpoint, an unknown repo or revision) is final: the chain
goes on only past a source that cannot answer. The first answer becomes the ModelFacts through
`facts_from_answer`, the one place config fields and tensors are read; a later source's facts say why
the earlier ones were passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lmc.errors import InternalError, SpecValueError
from lmc.planner.checkpoint_facts import Answer, facts_from_answer
from lmc.planner.facts import ModelFacts


@dataclass(frozen=True)
class Wanted:
    """The model a plan asks for."""

    model_id: str
    revision: str | None = None  # a Hub branch, tag or commit (None: main)
    path: Path | None = None  # a local checkpoint directory, already resolved


@dataclass(frozen=True)
class Unavailable:
    """A source that cannot answer for this model, and why."""

    why: str
    error: SpecValueError | None = None  # shown when no later source answers; None: not this source's case


Source = Callable[[Wanted], "Answer | Unavailable"]


def local_checkpoint(wanted: Wanted) -> Answer | Unavailable:
    """The checkpoint directory the spec names."""
    from lmc.planner.checkpoint_facts import local_answer

    if wanted.path is None:
        return Unavailable("no model.path")
    return local_answer(wanted.path, wanted.model_id)


def hub(wanted: Wanted) -> Answer | Unavailable:
    """The Hub, online."""
    return _hub_or_cache(wanted, offline=False)


def hf_cache(wanted: Wanted) -> Answer | Unavailable:
    """The HF cache, under HF_HUB_OFFLINE."""
    return _hub_or_cache(wanted, offline=True)


def _hub_or_cache(wanted: Wanted, *, offline: bool) -> Answer | Unavailable:
    from huggingface_hub import constants

    from lmc.hub import HubUnavailable, hub_answer

    if constants.HF_HUB_OFFLINE != offline:
        return Unavailable("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "HF_HUB_OFFLINE is not set")
    try:
        return hub_answer(wanted.model_id, wanted.revision, offline=offline)
    except HubUnavailable as exc:
        return Unavailable(f"the Hub was not used: {exc.detail}", exc)


def built_in_catalog(wanted: Wanted) -> Answer | Unavailable:
    """The built-in catalog's published config.json, for the ids it holds (never a pinned revision)."""
    from lmc.planner import catalog

    if wanted.revision is not None:
        return Unavailable("the catalog holds no revisions")
    if not catalog.has_model(wanted.model_id):
        return Unavailable("not in the catalog")
    return catalog.model_answer(wanted.model_id)


SOURCES: tuple[Source, ...] = (local_checkpoint, hub, hf_cache, built_in_catalog)


def read_model_facts(wanted: Wanted) -> ModelFacts:
    """The facts of the first source in SOURCES that answers for `wanted`; one-line errors."""
    passed: list[Unavailable] = []
    for source in SOURCES:
        found = source(wanted)
        if isinstance(found, Unavailable):
            passed.append(found)
            continue
        facts = facts_from_answer(found)
        reasons = [unavailable.why for unavailable in passed if unavailable.error is not None]
        if reasons:
            facts = facts.model_copy(update={"source": f"{facts.source} ({'; '.join(reasons)})"})
        return facts
    errors = [unavailable.error for unavailable in passed if unavailable.error is not None]
    if not errors:
        raise InternalError(f"no source of model facts answered for {wanted.model_id} and none said why")
    raise errors[-1]
