"""The latency and cost model: physics (bytes over bandwidth, FLOPs over TFLOPS, all-reduces over
the interconnect) with efficiency figures calibrated on public measurements (engines.toml).

Decode step (TPOT), per rank:
    memory  = (decode weight bytes + KV bytes of the batch at the average context) / effective bandwidth
              effective bandwidth = peak · decode_bandwidth · tp_efficiency^log2(TP)
    compute = 2 · active decode parameters / TP · batch / (peak TFLOPS · prefill_compute)
    comm    = all-reduces per step · (2(TP−1)/TP · batch·hidden·bytes / (link bw · allreduce_efficiency)
              + link latency)
    fixed   = step_overhead + layers · layer_overhead
    TPOT    = memory + compute + comm + fixed   (no overlap assumed between memory and compute)
Prefill (TTFT, one max_input_tokens prompt):
    max(2 · active parameters · input / TP + causal attention FLOPs, weight bytes / bandwidth)
    + all-reduces of input·hidden activations + fixed.
MoE: compute uses the active parameters (experts_per_token of num_experts); the bandwidth term reads
the experts the batch touches: E · (1 − (1 − k/E)^batch) of them per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmc.planner.facts import DTYPE_BYTES, EngineEfficiency, EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.measured import measured_efficiency
from lmc.planner.memory import (
    WEIGHT_ONLY,
    compute_dtype,
    decode_weight_bytes,
    decoder_share,
    host_share,
    kv_bytes_per_token,
    param_split,
    weight_bytes,
)


@dataclass(frozen=True)
class Timing:
    """One configuration's predicted figures (unrounded)."""

    ttft_ms: float
    tpot_ms: float
    throughput_tokens_per_s: float
    load_seconds: float
    cost_per_hour: float | None
    cost_per_million_tokens: float | None
    instances_used: int


def efficiency_for(engine: EngineFacts, model: ModelFacts, hardware: HardwareFacts,
                   dtype: str | None = None) -> EngineEfficiency:
    """The engine's figures for this hardware; DeepSpeed AutoTP (no fused kernels) has its own. A
    measured profile's figures for the engine replace them (per `dtype` where given: measured.py)."""
    efficiency = engine.efficiency[hardware.kind]
    if engine.kernel_injection_families and model.family not in engine.kernel_injection_families:
        efficiency = engine.unfused_efficiency.get(hardware.kind, efficiency)
    act = compute_dtype(dtype, model, hardware) if dtype is not None else None
    return measured_efficiency(efficiency, hardware, engine.name, dtype, act)


def peak_tflops(hardware: HardwareFacts, dtype: str) -> float:
    """Dense peak TFLOPS for the compute dtype; the lowest listed figure when the dtype is absent."""
    if dtype in hardware.tflops:
        return hardware.tflops[dtype]
    return min(hardware.tflops.values()) if hardware.tflops else 1.0


def allreduce_ms(hardware: HardwareFacts, efficiency: EngineEfficiency, tp: int, message_bytes: float) -> float:
    """One all-reduce of `message_bytes` across `tp` ranks: ring bandwidth term + fixed latency.

    The interconnect's latency_us is taken as the fixed cost of one small all-reduce (NCCL's
    low-latency protocol and Neuron collectives are nearly flat in the rank count within a node).
    """
    if tp <= 1:
        return 0.0
    link = hardware.interconnect
    bandwidth = 2 * (tp - 1) / tp * message_bytes / (link.bandwidth_bytes_per_s * efficiency.allreduce_efficiency)
    return bandwidth * 1e3 + link.latency_us * 1e-3


def allreduces_per_step(model: ModelFacts) -> int:
    """Row-parallel outputs reduced per decode step: attention and MLP per block (+ cross-attention for T5)."""
    return model.layers * (3 if model.is_encoder_decoder else 2)


def rank_tflops(hardware: HardwareFacts, dtype: str, tp: int) -> float:
    return peak_tflops(hardware, dtype) / host_share(hardware, tp)


def effective_bandwidth(hardware: HardwareFacts, efficiency: EngineEfficiency, tp: int) -> float:
    return (hardware.memory_bandwidth_bytes_per_s / host_share(hardware, tp) * efficiency.decode_bandwidth
            * efficiency.tp_efficiency ** math.log2(tp))


def _moe_touched_share(model: ModelFacts, batch: int) -> float:
    """Share of expert weights a decode step of `batch` tokens reads (uniform routing)."""
    if model.num_experts <= 1:
        return 1.0
    k, experts = model.experts_per_token, model.num_experts
    return 1 - (1 - k / experts) ** batch


def _expert_share(model: ModelFacts) -> float:
    """Share of the split matrices that are experts (0 for dense models)."""
    if model.num_experts <= 1:
        return 0.0
    experts = model.layers * model.num_experts * 3 * model.hidden_size * model.intermediate_size
    return min(experts / max(param_split(model).sharded, 1), 1.0)


def active_decode_parameters(model: ModelFacts) -> float:
    """Parameters one decoded token multiplies through: decoder matrices (active experts) + LM head."""
    split = param_split(model)
    matrices = split.sharded * decoder_share(model)
    share = _expert_share(model)
    if share:
        matrices = matrices * (1 - share) + matrices * share * model.experts_per_token / model.num_experts
    return matrices + model.vocab_size * model.hidden_size


def active_prefill_parameters(model: ModelFacts) -> float:
    """Parameters each prompt token multiplies through (the encoder's for T5, decoder's otherwise)."""
    split = param_split(model)
    matrices = split.sharded * (1 - decoder_share(model) if model.is_encoder_decoder else 1.0)
    share = _expert_share(model)
    if share:
        matrices = matrices * (1 - share) + matrices * share * model.experts_per_token / model.num_experts
    return matrices + model.vocab_size * model.hidden_size


def tpot_ms(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int, batch: int,
            input_tokens: int, output_tokens: int) -> float:
    """Time per output token at `batch` sequences, context averaged over the generation."""
    efficiency = efficiency_for(engine, model, hardware, dtype)
    act = compute_dtype(dtype, model, hardware)
    weights = decode_weight_bytes(model, engine, dtype, tp, hardware)
    share = _expert_share(model)
    if share:
        weights = weights * (1 - share) + weights * share * _moe_touched_share(model, batch)
    if model.is_encoder_decoder:
        context = input_tokens + output_tokens / 2  # cross-attention over the input + self-attention so far
    else:
        context = input_tokens + output_tokens / 2
    kv = batch * context * kv_bytes_per_token(model, tp, act)
    memory_ms = (weights + kv) / effective_bandwidth(hardware, efficiency, tp) * 1e3
    flops = 2 * active_decode_parameters(model) / tp * batch
    flops += 4 * batch * context * model.attention_heads * model.head_dim * model.layers / tp
    compute_ms = flops / (rank_tflops(hardware, act, tp) * 1e12 * efficiency.prefill_compute) * 1e3
    message = batch * model.hidden_size * DTYPE_BYTES[act]
    comm_ms = allreduces_per_step(model) * allreduce_ms(hardware, efficiency, tp, message)
    fixed_ms = efficiency.step_overhead_ms + model.layers * efficiency.layer_overhead_ms
    return memory_ms + compute_ms + comm_ms + fixed_ms


def ttft_ms(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
            input_tokens: int) -> float:
    """Time to first token for one prompt of `input_tokens`: the prefill, then its first token."""
    efficiency = efficiency_for(engine, model, hardware, dtype)
    act = compute_dtype(dtype, model, hardware)
    flops = 2 * active_prefill_parameters(model) * input_tokens / tp
    attention_layers = model.encoder_layers if model.is_encoder_decoder else model.layers
    flops += 2 * input_tokens * input_tokens * model.attention_heads * model.head_dim * attention_layers / tp
    compute_ms = flops / (rank_tflops(hardware, act, tp) * 1e12 * efficiency.prefill_compute) * 1e3
    memory_ms = weight_bytes(model, engine, dtype, tp, hardware) / effective_bandwidth(hardware, efficiency, tp) * 1e3
    message = input_tokens * model.hidden_size * DTYPE_BYTES[act]
    blocks = model.encoder_layers if model.is_encoder_decoder else model.layers
    comm_ms = 2 * blocks * allreduce_ms(hardware, efficiency, tp, message)
    fixed_ms = efficiency.step_overhead_ms + (blocks + model.layers) * efficiency.layer_overhead_ms
    prefill = max(compute_ms, memory_ms) + comm_ms + fixed_ms
    if model.is_encoder_decoder:  # then one decoder step yields the first token
        prefill += tpot_ms(model, hardware, engine, dtype, tp, 1, input_tokens, 1)
    return prefill


def load_seconds(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                 replicas_per_instance: int) -> float:
    """Seconds from container start to ready on one instance.

    Pre-partitioned shards: each rank reads only its own shard. Otherwise every rank reads the
    whole checkpoint and partitions it itself. Neuron graphs not serialized ahead of time are
    compiled at start (compile_seconds_per_billion_params).
    """
    efficiency = efficiency_for(engine, model, hardware)
    ranks = tp * replicas_per_instance
    if engine.prepartitioned_loading:
        total = weight_bytes(model, engine, dtype, tp, hardware) * ranks
    else:
        total = model.parameters * DTYPE_BYTES[dtype] * ranks
    seconds = total / (hardware.load_bandwidth_bytes_per_s * efficiency.load_efficiency)
    if engine.name == "neuronx" and model.family not in engine.aot_compile_families:
        seconds += engine.compile_seconds_per_billion_params * model.parameters / 1e9
    return seconds


def predict(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int, replicas: int,
            batch: int, input_tokens: int, output_tokens: int) -> Timing:
    """Every predicted figure for one configuration."""
    tpot = tpot_ms(model, hardware, engine, dtype, tp, batch, input_tokens, output_tokens)
    ttft = ttft_ms(model, hardware, engine, dtype, tp, input_tokens)
    per_instance = max(hardware.devices // tp, 1)
    instances = math.ceil(replicas / per_instance)
    throughput = replicas * batch / tpot * 1e3
    load = load_seconds(model, hardware, engine, dtype, tp, min(replicas, per_instance))
    if hardware.price_per_hour is None:
        cost_hour = cost_million = None
    else:
        cost_hour = hardware.price_per_hour * instances
        cost_million = cost_hour / (throughput * 3600) * 1e6
    return Timing(ttft, tpot, throughput, load, cost_hour, cost_million, instances)


__all__ = [
    "Timing", "WEIGHT_ONLY", "active_decode_parameters", "allreduce_ms", "efficiency_for", "load_seconds",
    "predict", "tpot_ms", "ttft_ms",
]
