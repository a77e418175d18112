"""Engine capabilities, loaded from data (lmc/planner/data/engines/engines.toml), cached.

Also loads the published measurements the latency model was calibrated and validated on
(validation.toml): docs/planner.md prints them and tests/test_planner_latency.py holds the model to them.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmc.errors import InternalError
from lmc.planner.facts import EngineFacts, HardwareFacts, ModelFacts

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_DATA = "lmc.planner.data.engines"


def _read_toml(name: str) -> dict[str, Any]:
    try:
        text = resources.files(_DATA).joinpath(name).read_text(encoding="utf-8")
        return tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InternalError(f"cannot read packaged planner data {name}: {exc}") from None


@functools.cache
def architectures(source: str) -> frozenset[str]:
    """The architectures a package registers, from the data files generated from the installed
    packages (python -m lmc.testing.architectures): "vllm", or "transformers" (AutoModelForCausalLM
    and, for multimodal wrappers, AutoModelForImageTextToText); also the parser names vLLM's server
    takes ("vllm_tool_parsers", "vllm_reasoning_parsers")."""
    names = {"vllm": ("vllm_architectures.txt",),
             "transformers": ("transformers_causal_lm.txt", "transformers_image_text_to_text.txt"),
             "vllm_tool_parsers": ("vllm_tool_parsers.txt",),
             "vllm_reasoning_parsers": ("vllm_reasoning_parsers.txt",)}[source]
    found: set[str] = set()
    for name in names:
        path = resources.files(_DATA).joinpath(name)
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                found.add(line)
    if not found:
        raise InternalError(f"packaged planner data for {source}'s architectures is missing")
    return frozenset(found)


def runs_architecture(engine: EngineFacts, model: ModelFacts) -> bool:
    """Whether the engine can build the model: its family is the engine's, or (vLLM, transformers) the
    config's architecture is one the installed package registers."""
    if model.family in engine.families:
        return True
    return engine.architectures is not None and model.architecture in architectures(engine.architectures)


@functools.cache
def engine_facts() -> dict[str, EngineFacts]:
    """Every engine's capabilities and efficiency figures, by engine name (sorted)."""
    raw = _read_toml("engines.toml")
    try:
        engines = {name: EngineFacts(name=name, **body) for name, body in raw["engine"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise InternalError(f"engines.toml does not validate: {exc}") from None
    return dict(sorted(engines.items()))


class Measurement(BaseModel):
    """One published measurement: time per output token, time to first token, or both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    role: str = Field(pattern="^(calibration|validation)$", description="Used to set a figure, or held out to check the model.")
    model: ModelFacts
    hardware: HardwareFacts
    engine: str
    dtype: str
    tensor_parallel_degree: int
    batch_size: int
    input_tokens: int
    output_tokens: int
    measured_tpot_ms: float | None = Field(default=None, gt=0, description="Published time per output token, ms.")
    measured_ttft_ms: float | None = Field(default=None, gt=0, description="Published time to first token for one input_tokens prompt, ms.")
    system: str = Field(default="", description="What ran it (gpt-fast, FasterTransformer, TGI 1.0.3, TensorRT-LLM 0.5, ...), when lmc's engine is a stand-in.")
    source: str
    note: str = ""

    @model_validator(mode="after")
    def _measures_something(self) -> "Measurement":
        if self.measured_tpot_ms is None and self.measured_ttft_ms is None:
            raise ValueError(f"{self.name}: neither measured_tpot_ms nor measured_ttft_ms")
        return self


@functools.cache
def measurements() -> tuple[Measurement, ...]:
    """The published measurements in validation.toml, with their model and hardware facts resolved."""
    raw = _read_toml("validation.toml")
    try:
        from lmc.planner import catalog

        models = {key: ModelFacts(**body) for key, body in raw["model"].items()}
        out = []
        for body in raw["measurement"]:
            body = dict(body)
            body["model"] = models[body["model"]]
            body["hardware"] = catalog.hardware_facts(body["hardware"])
            out.append(Measurement(**body))
    except (KeyError, TypeError, ValueError) as exc:
        raise InternalError(f"validation.toml does not validate: {exc}") from None
    return tuple(out)


def reference_model(key: str) -> ModelFacts:
    """A model from validation.toml by its key (tests use these realistic facts)."""
    raw = _read_toml("validation.toml")
    try:
        return ModelFacts(**raw["model"][key])
    except KeyError:
        raise InternalError(f"validation.toml has no [model.{key}]") from None
