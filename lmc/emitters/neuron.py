"""Ahead-of-time Neuron compile for `neuronx` plans, with transformers-neuronx.

Layout in the artifact (the runtime's neuronx engine and the LMI Neuron container read it):

    config.json, tokenizer files     the HF checkpoint directory ...
    model.safetensors                ... with the weights cast to the planned dtype, whole (not
                                     split: transformers-neuronx shards across NeuronCores itself
                                     when it loads, from `tp_degree`)
    neuron/compiled/                 the NEFFs written by `model.save()`; loaded with
                                     `cls.from_pretrained(<artifact>, **args); model.load(<this>);
                                     model.to_neuron()`  (LMI: option.compiled_graph_path)
    neuron/compile.json              what was compiled: class, from_pretrained arguments, compiler
                                     flags, SDK versions; or, when nothing was, why and when it is
    neuron/README.md                 the same, for people

transformers-neuronx serializes compiled graphs for every family it serves except GPT-J and
GPT-NeoX (`GPTJForSampling`, `GPTNeoXForSampling` have no save/load): for those, and when the
weights are remote (model.uri: nothing local to compile against), the artifact carries no NEFFs and
the graphs are compiled when the container starts; compile.json and the generated files say so,
with the plan's predicted load time.

Pure: `neuron_compile_plan(plan, checkpoint) -> CompileSpec` decides nothing the plan did not; it
spells out the call. Edge: `load_neuron_sdk()` imports the SDK (or fails with one line) and
`run_neuron_compile(spec, sdk)` runs it; tests inject a fake `transformers_neuronx` module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from lmc.environ import environ
from lmc.errors import InternalError, LmcError, MissingDependencyError
from lmc.neuron_sdk import (  # noqa: F401 (re-exported: the build's view of the shared conventions)
    AMP,
    COMPILED_DIR,
    NEURON_DIR,
    NEURON_OPTIMIZE_LEVEL,
    NEURON_PIP_INDEX,
    NEURON_SDK_PINS,
    NOT_SERIALIZABLE,
    SAMPLING_CLASSES,
    from_pretrained_kwargs,
    int8_neuron_config,
    neuron_cc_flags,
)
from lmc.planner.plan import Plan

COMPILE_RECORD = "neuron/compile.json"
README = "neuron/README.md"
WEIGHTS_FILE = "model.safetensors"

# NEURON_OPTIMIZE_LEVEL (lmc/neuron_sdk.py) is the Neuron compiler's default level (-O2). lmc's runtime
# sets the same NEURON_CC_FLAGS when it compiles at container start; option.neuron_optimize_level in
# serving.properties is for LMI's own handler (lmc's model.py entry point does not read it).

MISSING_SDK_MESSAGE = (
    "the neuronx build compiles Neuron graphs ahead of time with the Neuron SDK, which is not installed: "
    f"pip install transformers-neuronx torch-neuronx neuronx-cc --extra-index-url {NEURON_PIP_INDEX}, "
    "and run `lmc build` on a Neuron host (inf2/trn1 with the Neuron DLAMI) or in the Neuron deep learning container, "
    "with as many free NeuronCores as the plan's tensor parallel degree (transformers-neuronx 0.10 loads the weights "
    "onto the cores before it compiles)"
)


@dataclass(frozen=True)
class CompileSpec:
    """One transformers-neuronx compile, spelled out: what class, which arguments, where outputs land."""

    family: str
    class_name: str
    checkpoint: Path  # the HF directory compiled against; outputs land under it (neuron/...)
    from_pretrained: dict[str, Any]  # batch_size, tp_degree, n_positions, amp
    quantize_int8: bool
    neuron_cc_flags: str
    serializable: bool
    predicted_load_seconds: float
    model_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def compiled_dir(self) -> Path:
        return self.checkpoint / COMPILED_DIR


def sampling_class(family: str) -> str:
    try:
        return SAMPLING_CLASSES[family]
    except KeyError:
        raise InternalError(f"the plan chose neuronx for family {family!r}, which transformers-neuronx does not serve") from None


def graphs_precompiled(plan: Plan, weights_remote: bool) -> bool:
    """Whether the build compiles (and packs) the Neuron graphs, rather than the container at start."""
    return plan.engine == "neuronx" and plan.model.family not in NOT_SERIALIZABLE and not weights_remote


def not_precompiled_reason(plan: Plan, weights_remote: bool) -> str:
    """Why a neuronx artifact carries no NEFFs (the text the generated files repeat)."""
    if plan.model.family in NOT_SERIALIZABLE:
        return (f"transformers-neuronx cannot serialize compiled {sampling_class(plan.model.family)} graphs, "
                "so they are compiled when the container starts")
    if weights_remote:
        return "the weights are remote (model.uri), so the graphs are compiled when the container starts"
    return "the graphs are compiled at build time"


def neuron_compile_plan(plan: Plan, checkpoint: Path) -> CompileSpec:
    """The compile for `plan`, reading the cast checkpoint in `checkpoint` (config.json + model.safetensors)."""
    if plan.engine != "neuronx":
        raise InternalError(f"neuron_compile_plan called for a {plan.engine} plan")
    if plan.dtype not in AMP:
        raise InternalError(f"dtype {plan.dtype} reached the Neuron compile; the planner should have rejected it")
    family = plan.model.family
    return CompileSpec(
        family=family,
        class_name=sampling_class(family),
        checkpoint=Path(checkpoint),
        from_pretrained=from_pretrained_kwargs(family=plan.model.family, dtype=plan.dtype, batch_size=plan.batch_size,
                                               tp_degree=plan.tensor_parallel_degree,
                                               n_positions=plan.max_sequence_length),
        quantize_int8=plan.dtype == "int8",
        neuron_cc_flags=neuron_cc_flags(),
        serializable=family not in NOT_SERIALIZABLE,
        predicted_load_seconds=plan.predicted.load_seconds,
        model_id=plan.model.id,
    )


def load_neuron_sdk() -> ModuleType:
    """Import transformers-neuronx, or fail with one line saying what to install and where to run."""
    try:
        import transformers_neuronx  # noqa: PLC0415 (the SDK exists only on Neuron hosts)
    except ImportError:
        raise MissingDependencyError(MISSING_SDK_MESSAGE) from None
    return transformers_neuronx


def run_neuron_compile(spec: CompileSpec, sdk: ModuleType) -> list[Path]:
    """Compile and save the graphs under `spec.checkpoint`/neuron/; returns the files written.

    `sdk` is the transformers_neuronx module (injected by tests).
    """
    if not spec.serializable:
        raise InternalError(f"run_neuron_compile called for {spec.class_name}, whose graphs cannot be saved")
    cls = getattr(sdk, spec.class_name, None)
    if cls is None:
        raise MissingDependencyError(
            f"the installed transformers-neuronx has no {spec.class_name}; install transformers-neuronx=="
            f"{NEURON_SDK_PINS['transformers-neuronx']} --extra-index-url {NEURON_PIP_INDEX}")
    kwargs = dict(spec.from_pretrained)
    if spec.quantize_int8:
        kwargs["neuron_config"] = int8_neuron_config(sdk, kwargs["amp"])
    out = spec.compiled_dir
    out.mkdir(parents=True, exist_ok=True)
    try:
        with environ(NEURON_CC_FLAGS=spec.neuron_cc_flags):
            model = cls.from_pretrained(str(spec.checkpoint), **kwargs)
            model.to_neuron()
            model.save(str(out))
    except LmcError:
        raise
    except Exception as exc:  # the compiler's own failure: the user's model or host, not lmc
        raise LmcError(f"Neuron compile of {spec.model_id or spec.family} ({spec.class_name}) failed: "
                       f"{type(exc).__name__}: {_one_line(exc)}") from None
    if not any(p.is_file() for p in out.rglob("*")):
        raise InternalError(f"{spec.class_name}.save({out}) wrote no files")
    write_compile_record(spec.checkpoint, compile_record(spec, sdk_versions(sdk)))
    return sorted(p for p in (spec.checkpoint / NEURON_DIR).rglob("*") if p.is_file())


def _compile_call(spec: CompileSpec) -> dict[str, Any]:
    """The transformers-neuronx call a compile record describes, whenever it runs."""
    return {
        "class": f"transformers_neuronx.{spec.class_name}",
        "from_pretrained": {k: spec.from_pretrained[k] for k in sorted(spec.from_pretrained)},
        "quantize_int8": spec.quantize_int8,
        "neuron_cc_flags": spec.neuron_cc_flags,
    }


def compile_record(spec: CompileSpec, versions: dict[str, str]) -> dict[str, Any]:
    """neuron/compile.json for graphs compiled at build time."""
    return {
        "compiled": True,
        **_compile_call(spec),
        "graphs": COMPILED_DIR,
        "weights": WEIGHTS_FILE,
        "load": f"{spec.class_name}.from_pretrained(<artifact>, **from_pretrained); model.load('<artifact>/{COMPILED_DIR}'); model.to_neuron()",
        "sdk_versions": versions,
    }


def deferred_compile_record(plan: Plan, weights_remote: bool) -> dict[str, Any]:
    """neuron/compile.json when the graphs are compiled at container start."""
    spec = neuron_compile_plan(plan, Path("."))
    return {
        "compiled": False,
        **_compile_call(spec),
        "reason": not_precompiled_reason(plan, weights_remote),
        "predicted_load_seconds_including_compile": round(plan.predicted.load_seconds, 1),
        "weights": None if weights_remote else WEIGHTS_FILE,
        "sdk_versions": dict(NEURON_SDK_PINS),
    }


def write_compile_record(root: Path, record: dict[str, Any]) -> Path:
    path = Path(root) / COMPILE_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def sdk_versions(sdk: ModuleType) -> dict[str, str]:
    """Installed SDK versions (the NEFFs are only valid under the compiler that made them)."""
    from importlib import metadata

    versions: dict[str, str] = {}
    for dist in NEURON_SDK_PINS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    if versions["transformers-neuronx"] == "unknown" and isinstance(getattr(sdk, "__version__", None), str):
        versions["transformers-neuronx"] = sdk.__version__
    return versions


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")
