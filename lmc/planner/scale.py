"""Scale: pipeline stages across instances, and the instance count a request rate needs. Pure math.

Pipeline parallelism (docs/planner.md, "Across instances"): a model copy is split by layers into
`pp` stages, one per instance, each stage tensor-parallel over that instance's devices. A token
passes the stages in turn (no overlap of micro-batches is assumed), so a decode step costs what it
costs on one instance plus (pp − 1) hand-overs of the batch's hidden states over the network
between instances; a prefill hands over the prompt's hidden states. Each instance loads only its
stage, so the load time divides by the stages where the engine loads pre-partitioned weights.

Rate (planner/goals.py): the planned replicas carry throughput / max_output_tokens requests per
second; the instance count is what the rate needs at each replica's share of that, in whole pipeline
groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lmc.planner.facts import DTYPE_BYTES, EngineFacts, HardwareFacts, InterconnectFacts, ModelFacts
from lmc.planner.goals import replicas_for_rate, requests_per_second
from lmc.planner.latency import Timing, copy_instances, cost_figures
from lmc.planner.memory import compute_dtype, param_split

MAX_PIPELINE_DEGREE = 16  # stages the search tries on its own; a pin may ask for more (up to the schema's 64)


def stage_layers(model: ModelFacts, pp: int) -> int:
    """Blocks in the largest stage: the layers split as evenly as they go."""
    return math.ceil(model.layers / pp)


def stage_model(model: ModelFacts, pp: int) -> ModelFacts:
    """The heaviest pipeline stage as a model of its own, for the memory math: ceil(layers / pp)
    blocks and one vocab × hidden matrix (the first stage's embedding or the last stage's LM head,
    taken as a replicated tied embedding: the larger of the two on a TP rank)."""
    if pp <= 1:
        return model
    split = param_split(model)
    layers = stage_layers(model, pp)
    replicated = layers * 4 * model.hidden_size + model.hidden_size
    if model.num_experts > 1:
        replicated += layers * model.num_experts * model.hidden_size
    sharded = round(split.sharded * layers / model.layers)
    parameters = split.embedding + replicated + sharded
    update = {"layers": layers, "parameters": parameters, "tie_word_embeddings": True,
              "expert_parameters": round(model.expert_parameters * layers / model.layers),
              "active_parameters": 0, "moe_layers": None if model.moe_layers is None else
              min(model.moe_layers, layers)}
    if model.checkpoint_weight_bytes:  # a quantized checkpoint: the stage's share of its bytes
        update["checkpoint_weight_bytes"] = round(model.checkpoint_weight_bytes * parameters / model.parameters)
    if model.sliding_window_layers:
        update["sliding_window_layers"] = round(model.sliding_window_layers * layers / model.layers)
    return model.model_copy(update=update)


def pipeline_unsupported(pp: int, engine: EngineFacts, model: ModelFacts, hardware: HardwareFacts) -> str | None:
    """None when `engine` can run `model` as `pp` stages across instances of `hardware`, else why not."""
    if pp <= 1:
        return None
    if model.family not in engine.pipeline_families and not engine.pipeline_any_architecture:
        can = ", ".join(engine.pipeline_families) or "no family"
        return f"{engine.name} cannot split {model.family} into pipeline stages (it splits {can})"
    if model.is_encoder_decoder:
        return "encoder-decoder models are not split into pipeline stages"
    if pp > model.layers:
        return f"{pp} stages exceed the {model.layers} layers"
    if hardware.network is None:
        return f"the catalog has no network facts for {hardware.name} (the link between instances)"
    return None


def hop_ms(network: InterconnectFacts, message_bytes: float) -> float:
    """One stage-to-stage hand-over of `message_bytes` over the network: latency + bytes / bandwidth."""
    return network.latency_us * 1e-3 + message_bytes / network.bandwidth_bytes_per_s * 1e3


def instances_for(replicas: int, per_instance: int, nodes: int) -> int:
    """Instances `replicas` copies need: whole groups of `nodes` instances each (pipeline stages, or
    data-parallel groups across instances) where a copy needs more than one."""
    return math.ceil(replicas / per_instance) * nodes


@dataclass(frozen=True)
class Scaled:
    """A configuration's figures across instances."""

    timing: Timing
    requests_per_second: float  # what the planned replicas carry
    peak_instances: int  # instances the peak rate needs (= timing.instances_used without a rate)


def scale_timing(timing: Timing, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str,
                 tp: int, pp: int, replicas: int, batch: int, input_tokens: int, output_tokens: int,
                 peak_rate: float | None = None, staged: bool = False) -> Scaled:
    """`timing` (one instance per replica's stages, from latency.predict) across `pp` stages and the
    instances `replicas` need: hand-overs added to TPOT and TTFT, load per stage, instances and cost.
    `staged`: `timing` is already across the stages (vLLM's pipeline, planner/vllm.py), with `batch`
    sequences in each of its `pp` micro-batches."""
    per_instance = max(hardware.devices // tp, 1)
    nodes = pp * copy_instances(hardware, tp)  # instances per copy: its stages, or its ranks across instances
    if pp == 1 or staged:  # the engine's own prediction stands (vLLM's, across its stages, included)
        scaled = timing
        batch = batch * pp if staged else batch
    else:
        scaled = _across_stages(timing, model, hardware, engine, dtype, tp, pp, replicas, batch, input_tokens)
    rps = requests_per_second(scaled.throughput_tokens_per_s, output_tokens)
    peak = scaled.instances_used
    if peak_rate is not None:
        peak = max(peak, instances_for(replicas_for_rate(peak_rate, rps / replicas), per_instance, nodes))
    return Scaled(scaled, rps, peak)


def _across_stages(timing: Timing, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str,
                   tp: int, pp: int, replicas: int, batch: int, input_tokens: int) -> Timing:
    """`timing` of one instance per replica plus (pp − 1) hand-overs; each instance loads its stage."""
    assert hardware.network is not None  # pipeline_unsupported said so
    width = model.hidden_size * DTYPE_BYTES[compute_dtype(dtype, model, hardware)]
    tpot = timing.tpot_ms + (pp - 1) * hop_ms(hardware.network, batch * width)
    ttft = timing.ttft_ms + (pp - 1) * hop_ms(hardware.network, input_tokens * width)
    load = timing.load_seconds / pp if engine.prepartitioned_loading else timing.load_seconds
    per_instance = max(hardware.devices // tp, 1)
    instances = instances_for(replicas, per_instance, pp)
    throughput = replicas * batch / tpot * 1e3
    cost_hour, cost_million = cost_figures(hardware, instances, throughput)
    return replace(timing, ttft_ms=ttft, tpot_ms=tpot, throughput_tokens_per_s=throughput, load_seconds=load,
                   cost_per_hour=cost_hour, cost_per_million_tokens=cost_million, instances_used=instances)
