"""The edge between a loaded spec and the pure planner: gather facts, plan, locate errors.

Facts-gathering (catalog files, a checkpoint's config.json and safetensors headers) happens here;
the arithmetic happens in `lmc.planner`. Spec-level errors raised by either come back as one line
with the spec's file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmc import __version__
from lmc.errors import SpecValueError
from lmc.planner.facts import HardwareFacts, ModelFacts
from lmc.planner.plan import Plan
from lmc.schema import LoadedSpec


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    model: ModelFacts
    hardware: HardwareFacts
    checkpoint: Path | None  # the resolved model.path, when the spec gives one


def plan_from_spec(loaded: LoadedSpec) -> PlanResult:
    """Facts for the spec's model and target, then the plan. Raises LmcError (one line)."""
    try:
        checkpoint = _checkpoint_dir(loaded)
        model = _model_facts(loaded, checkpoint)
        from lmc.served_facts import with_served_facts

        model = with_served_facts(loaded, model, checkpoint)
        hardware = _hardware_facts(loaded)
        from lmc.planner import plan_deployment

        plan = plan_deployment(loaded.spec, model, hardware, spec_sha256=loaded.sha256, lmc_version=__version__)
        from lmc.planner.steps import save_step_times

        save_step_times()  # the measured step times it looked up, for the next plan of the same deployment
    except SpecValueError as exc:
        raise loaded.source.error(exc.key_path, exc.detail, exc.value) from None
    return PlanResult(plan=plan, model=model, hardware=hardware, checkpoint=checkpoint)


def _checkpoint_dir(loaded: LoadedSpec) -> Path | None:
    relative = loaded.spec.model.path
    if relative is None:
        return None
    path = loaded.source.resolve(relative)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "no such checkpoint directory"
        raise SpecValueError("model.path", relative, f"{what} ({path})")
    return path


def _model_facts(loaded: LoadedSpec, checkpoint: Path | None) -> ModelFacts:
    """From the first of model.path, the Hub, the HF cache and the catalog that answers (lmc/model_sources.py)."""
    from lmc.model_sources import Wanted, read_model_facts

    model = loaded.spec.model
    return read_model_facts(Wanted(model.id, model.revision, checkpoint))


def _hardware_facts(loaded: LoadedSpec) -> HardwareFacts:
    from lmc.planner import catalog

    target = loaded.spec.target
    if target.profile is not None:
        facts = catalog.profile_facts(loaded.source.resolve(target.profile))
        _check_profile_matches(target, facts)
        return facts
    if target.instance == "local":
        return catalog.local_facts()
    if target.instance is not None:
        return catalog.hardware_facts(target.instance)
    assert target.accelerator is not None and target.devices is not None  # the schema guarantees it
    return catalog.accelerator_facts(target.accelerator, target.devices)


def _check_profile_matches(target, facts: HardwareFacts) -> None:
    """A measured profile describes the hardware; the target must name the same thing, or a typo in
    `instance` (or another accelerator) would be planned for silently on the profile's hardware."""
    from lmc.errors import SpecValueError
    from lmc.planner import catalog

    if target.instance is not None:
        key = target.instance.strip().lower()
        named = key if key == "local" else catalog.hardware_facts(target.instance).name.lower()
        if named != facts.name.lower():
            raise SpecValueError("target.instance", target.instance,
                                 f"the profile {target.profile} describes {facts.name}; name the same target")
    else:
        named = catalog.accelerator_facts(target.accelerator, target.devices)
        if (named.accelerator, named.devices) != (facts.accelerator, facts.devices):
            raise SpecValueError("target.accelerator", target.accelerator,
                                 f"the profile {target.profile} describes {facts.devices} × {facts.accelerator}; "
                                 "name the same hardware")
