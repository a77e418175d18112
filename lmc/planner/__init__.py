"""The planner: facts in, a frozen Plan out. Pure: no torch, no network, no disk beyond packaged data."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmc.planner.facts import EngineFacts, HardwareFacts, ModelFacts
    from lmc.planner.plan import Plan
    from lmc.schema.spec import Spec


def plan_deployment(spec: "Spec", model: "ModelFacts", hardware: "HardwareFacts",
                    engines: "dict[str, EngineFacts] | None" = None, *, spec_sha256: str, lmc_version: str,
                    candidates: "list[HardwareFacts] | None" = None) -> "Plan":
    """Choose engine, dtype, TP degree, replicas and batching for `spec` on `hardware`.

    `candidates`: other hardware to suggest when nothing fits (default: the catalog's, if it has any).
    Raises SpecValueError for a pin or workload that cannot work, NoFeasiblePlanError when nothing fits.
    """
    from lmc.planner.search import plan_deployment as _plan

    return _plan(spec, model, hardware, engines, spec_sha256=spec_sha256, lmc_version=lmc_version,
                 candidates=candidates)


__all__ = ["plan_deployment"]
