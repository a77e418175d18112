"""The spec: strict models, TOML loading with key-path errors, size units."""

from lmc.schema.loader import LoadedSpec, SpecSource, load_spec, parse_spec, spec_sha256
from lmc.schema.spec import (
    BudgetSpec,
    DeploySpec,
    Dtype,
    Engine,
    GoalSpec,
    ModelSpec,
    PinSpec,
    Spec,
    TargetSpec,
    WorkloadSpec,
)
from lmc.schema.units import format_bytes, parse_size

__all__ = [
    "BudgetSpec", "DeploySpec", "Dtype", "Engine", "GoalSpec", "LoadedSpec", "ModelSpec", "PinSpec", "Spec",
    "SpecSource", "TargetSpec", "WorkloadSpec", "format_bytes", "load_spec", "parse_size",
    "parse_spec", "spec_sha256",
]
