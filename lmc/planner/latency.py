"""The latency and cost model: physics (bytes over bandwidth, FLOPs over TFLOPS, all-reduces over
the interconnect) with efficiency figures calibrated on public measurements (engines.toml;
docs/planner.md has the formulas, the sources and the errors on the published table).

Decode step (TPOT), per rank:
    memory  = (decode weight bytes + KV bytes of the batch at the average context) / effective bandwidth
              effective bandwidth = peak · decode_bandwidth · tp_efficiency^log2(TP)
    compute = 2 · active decode parameters / TP · batch / (peak TFLOPS · decode_compute)
    comm    = all-reduces per step · (allreduce_us(interconnect, TP, batch·hidden·bytes) + engine overhead)
              ring: base + 2(TP−1)·step latency + 2(TP−1)/TP · bytes / (link bw · allreduce_efficiency)
    fixed   = step_overhead + layers · layer_overhead     (does not shrink with TP)
              + MoE blocks · moe_layer_overhead · (1 − share of experts the batch touches)
    TPOT    = memory + compute + comm + fixed   (no overlap assumed between memory and compute)
Prefill (TTFT, one max_input_tokens prompt), compute-bound:
    (2 · active parameters · input / TP + attention FLOPs) / (peak TFLOPS · prefill_compute)
    + weight bytes / bandwidth + all-reduces of input·hidden activations + fixed + prefill_overhead.
MoE: compute uses the active parameters (experts_per_token of num_experts); the bandwidth term reads
the experts the batch touches: E · (1 − (1 − k/E)^batch) of them per layer; with expert parallelism
(whole experts per rank) the busiest rank's share, E[max over ranks] of its Binomial count (expert_imbalance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmc.layouts import instances_spanned
from lmc.planner.facts import DTYPE_BYTES, EngineEfficiency, EngineFacts, HardwareFacts, InterconnectFacts, ModelFacts
from lmc.planner.measured import measured_efficiency
from lmc.planner.memory import (
    WEIGHT_ONLY,
    compute_dtype,
    decode_weight_bytes,
    decoder_share,
    host_share,
    kv_sequence_bytes,
    materializes_attention_scores,
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
    step_times: str = ""  # the step-time model behind these figures (planner/steps.py)
    slot_ttft_ms: float | None = None  # TTFT of a request that finds a free slot (ttft_ms adds the queue, if any)

    @property
    def own_ttft_ms(self) -> float:
        """TTFT once a request runs, without waiting for a slot (goals.py adds its own queueing to it)."""
        return self.ttft_ms if self.slot_ttft_ms is None else self.slot_ttft_ms


def efficiency_for(engine: EngineFacts, model: ModelFacts, hardware: HardwareFacts,
                   dtype: str | None = None) -> EngineEfficiency:
    """The engine's figures for this hardware; DeepSpeed AutoTP (no fused kernels) has its own. A
    measured profile's figures for the engine replace them (per `dtype` where given: measured.py)."""
    efficiency = engine.efficiency[hardware.kind]
    if not engine.fused(model.family):
        efficiency = engine.unfused_efficiency.get(hardware.kind, efficiency)
    act = compute_dtype(dtype, model, hardware) if dtype is not None else None
    return measured_efficiency(efficiency, hardware, engine.name, dtype, act)


def peak_tflops(hardware: HardwareFacts, dtype: str) -> float:
    """Dense peak TFLOPS for the compute dtype; the lowest listed figure when the dtype is absent."""
    if dtype in hardware.tflops:
        return hardware.tflops[dtype]
    return min(hardware.tflops.values()) if hardware.tflops else 1.0


def allreduce_us(link: InterconnectFacts, ranks: int, message_bytes: float, bandwidth_efficiency: float = 1.0) -> float:
    """One all-reduce of `message_bytes` across `ranks` over `link`, microseconds.

    Ring (NCCL inside a node, gloo, Neuron collectives): 2(p−1) steps, each paying the link's
    latency, and 2(p−1)/p of the message over its bandwidth. Tree (NCCL across nodes): 2·ceil(log2 p)
    steps (up the tree and down again) and twice the message (NCCL's tree moves data at half the bus
    bandwidth). Both add the link's fixed per-call cost. One rank: nothing to reduce.
    """
    if ranks <= 1:
        return 0.0
    if link.algorithm == "tree":
        steps = 2 * math.ceil(math.log2(ranks))
        volume = 2 * message_bytes
    else:
        steps = 2 * (ranks - 1)
        volume = 2 * (ranks - 1) / ranks * message_bytes
    transfer = volume / (link.bandwidth_bytes_per_s * bandwidth_efficiency) * 1e6
    return link.allreduce_base_us + steps * link.latency_us + transfer


def send_us(link: InterconnectFacts, message_bytes: float, bandwidth_efficiency: float = 1.0) -> float:
    """One point-to-point transfer of `message_bytes` over `link` (a pipeline stage boundary), microseconds."""
    return link.allreduce_base_us + link.latency_us + message_bytes / (link.bandwidth_bytes_per_s * bandwidth_efficiency) * 1e6


def allreduce_ms(hardware: HardwareFacts, efficiency: EngineEfficiency, tp: int, message_bytes: float) -> float:
    """One tensor-parallel all-reduce inside an instance as the engine runs it: the link's cost
    (`allreduce_us` at the engine's achieved bandwidth) plus the engine's own per-call overhead."""
    if tp <= 1:
        return 0.0
    custom = custom_allreduce_us(hardware.interconnect, efficiency, tp, message_bytes)
    if custom is not None:
        return (custom + efficiency.allreduce_overhead_us) * 1e-3
    link = allreduce_us(hardware.interconnect, tp, message_bytes, efficiency.allreduce_efficiency)
    return (link + efficiency.allreduce_overhead_us) * 1e-3


# vLLM's custom all-reduce (vllm/distributed/device_communicators/custom_all_reduce.py): 2, 4, 6 or 8 ranks,
# messages up to 8 MiB (max_size); on PCIe only for 2 ranks. Its kernels (csrc/custom_all_reduce.cuh): one
# stage (every rank reads the whole message from each peer and reduces) for 2 ranks, or on NVLink below
# 512 KiB at ≤ 4 ranks and 256 KiB at ≤ 8; otherwise two (reduce-scatter, then all-gather, each reading
# (p − 1)/p of it). Larger messages, other degrees: NCCL.
CUSTOM_ALLREDUCE_RANKS = (2, 4, 6, 8)
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 2**20


def custom_allreduce_us(link: InterconnectFacts, efficiency: EngineEfficiency, ranks: int,
                        message_bytes: float) -> float | None:
    """One all-reduce by the engine's own kernels (vLLM's custom all-reduce), microseconds; None where the
    engine has none or hands this one to NCCL. Each stage pays the kernel's fixed cost
    (`custom_allreduce_base_us`: launch inside the CUDA graph and the cross-GPU flag barrier) and one link
    latency, and moves its bytes at the link's achieved bandwidth."""
    base = efficiency.custom_allreduce_base_us
    if base is None or ranks not in CUSTOM_ALLREDUCE_RANKS or message_bytes > CUSTOM_ALLREDUCE_MAX_BYTES:
        return None
    nvlink = "nvlink" in link.name.lower()
    if not nvlink and ranks > 2:
        return None
    small = 512 * 1024 if ranks <= 4 else 256 * 1024
    if ranks == 2 or message_bytes < small:
        stages, volume = 1, (ranks - 1) * message_bytes
    else:
        stages, volume = 2, 2 * (ranks - 1) / ranks * message_bytes
    transfer = volume / (link.bandwidth_bytes_per_s * efficiency.allreduce_efficiency) * 1e6
    return stages * (base + link.latency_us) + transfer


def allreduces_per_step(model: ModelFacts) -> int:
    """Row-parallel outputs reduced per decode step: attention and MLP per block (+ cross-attention for T5)."""
    return model.layers * (3 if model.is_encoder_decoder else 2)


def rank_tflops(hardware: HardwareFacts, dtype: str, tp: int, dp: int = 1) -> float:
    """One rank's share of the peak: on a CPU host all tp × dp ranks (processes) share the cores."""
    return peak_tflops(hardware, dtype) / host_share(hardware, tp * dp)


def effective_bandwidth(hardware: HardwareFacts, efficiency: EngineEfficiency, tp: int, dp: int = 1) -> float:
    """One rank's achieved memory bandwidth (on a CPU host all tp × dp ranks share it)."""
    return (hardware.memory_bandwidth_bytes_per_s / host_share(hardware, tp * dp) * efficiency.decode_bandwidth
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
    return min(model.routed_experts / max(param_split(model).sharded, 1), 1.0)


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


def moe_layer_count(model: ModelFacts) -> int:
    """Blocks with routed experts (0 for a dense model)."""
    if model.num_experts <= 1:
        return 0
    return model.layers if model.moe_layers is None else model.moe_layers


def copy_instances(hardware: HardwareFacts, ranks: int) -> int:
    """Instances one model copy's `ranks` (TP × DP, one stage) span on `hardware` (lmc.layouts.instances_spanned)."""
    return instances_spanned(ranks, hardware.devices, hardware.kind == "cpu")


def allgather_ms(hardware: HardwareFacts, efficiency: EngineEfficiency, ranks: int, total_bytes: float) -> float:
    """One all-gather (or reduce-scatter: the same traffic) of `total_bytes` in all over `ranks`, as NCCL's
    ring runs it: each rank receives (ranks − 1)/ranks of the bytes over the instance's link. Where the
    ranks span instances, each instance also takes in (ranks − 1)/ranks of the bytes over its `network`
    (every ring crosses into it once, each ring on its own NIC; the bandwidth is per instance); the two run
    at once, so the slower counts. Latency by NCCL's ring count: (instances − 1) steps over the network,
    the other (ranks − instances) over the link. Without network facts, the link alone."""
    if ranks <= 1:
        return 0.0
    link = hardware.interconnect
    share = total_bytes * (ranks - 1) / ranks
    inside = share / (link.bandwidth_bytes_per_s * efficiency.allreduce_efficiency) * 1e6
    instances = copy_instances(hardware, ranks)
    network = hardware.network
    if instances <= 1 or network is None:
        latency = link.allreduce_base_us + (ranks - 1) * link.latency_us
        return (latency + inside + efficiency.allreduce_overhead_us) * 1e-3
    outside = share / (network.bandwidth_bytes_per_s * efficiency.allreduce_efficiency) * 1e6
    latency = (link.allreduce_base_us + (ranks - instances) * link.latency_us + network.allreduce_base_us
               + (instances - 1) * network.latency_us)
    return (latency + max(inside, outside) + efficiency.allreduce_overhead_us) * 1e-3


def expert_imbalance(model: ModelFacts, ranks: int, tokens: int) -> float:
    """With expert parallelism over `ranks` (each holds num_experts / ranks whole experts), how many more
    experts the busiest rank reads in a step of `tokens` routed tokens than a rank does on average: every rank
    waits for the busiest at the step's collectives. Each rank's touched experts are counted as
    Binomial(experts per rank, touched share) under uniform routing, and the ratio is E[max of `ranks` of them]
    over their mean (1 where experts are split over the ranks instead, or all are touched). A trained router's
    skew only adds to it."""
    if model.num_experts <= 1 or ranks <= 1 or model.num_experts % ranks:
        return 1.0
    per_rank = model.num_experts // ranks
    p = _moe_touched_share(model, tokens)
    if p <= 0.0 or p >= 1.0:
        return 1.0
    below = 0.0  # P(count <= m) for one rank
    expected_max = 0.0
    for m in range(per_rank):
        below = min(below + math.comb(per_rank, m) * p ** m * (1 - p) ** (per_rank - m), 1.0)
        expected_max += 1.0 - below ** ranks
    return expected_max / (per_rank * p)


def dp_weight_bytes(weights: float, model: ModelFacts, dp: int, tokens: int | None = None,
                    ranks: int = 1) -> float:
    """Per-rank weight bytes with data-parallel attention over `dp` groups and expert parallelism: the
    routed experts are spread over dp times the ranks. `tokens`: a step's tokens (all groups'), which
    decide the experts it reads; None: every expert the rank holds. `ranks` > 1: whole experts over that many
    ranks (expert parallelism), and the busiest rank's experts count (`expert_imbalance`)."""
    share = _expert_share(model)
    if not share:
        return weights
    touched = 1.0 if tokens is None else _moe_touched_share(model, tokens) * expert_imbalance(model, ranks, tokens)
    return weights * (1 - share) + weights * share * min(touched, 1.0) / dp


def _dp_comm_ms(model: ModelFacts, hardware: HardwareFacts, efficiency: EngineEfficiency, tp: int, dp: int,
                tokens: int, act: str, gathered: int | None = None) -> float:
    """A step's collectives for `tokens` on one group's ranks. Tensor parallel alone: two all-reduces per
    block. Data-parallel attention with expert parallelism, as vLLM's default all2all backend
    (allgather_reducescatter) runs it: attention (and dense MLPs) all-reduce within the TP group; each MoE
    block all-gathers every group's tokens' hidden states over the tp × dp ranks (dispatch) and
    reduce-scatters the experts' results back (combine), over the network too where the ranks span
    instances; with TP > 1 each group's ranks hold a slice of its tokens (vLLM's sequence-parallel MoE) and
    all-gather the block's output within the group. `gathered`: the tokens all groups bring to a step
    (default: `tokens` from each of the dp groups). The router's top-k ids and weights that travel with the
    hidden states are left out (k·8 bytes a token against hidden·2)."""
    width = model.hidden_size * DTYPE_BYTES[act]
    message = tokens * width
    if dp <= 1:
        return (allreduces_per_step(model) * allreduce_ms(hardware, efficiency, tp, message)
                + qk_norm_allreduce_ms(model, hardware, efficiency, tp, tokens))
    moe = moe_layer_count(model)
    reduces = model.layers + (model.layers - moe)
    total = (dp * tokens if gathered is None else gathered) * width
    block = 2 * allgather_ms(hardware, efficiency, tp * dp, total) + allgather_ms(hardware, efficiency, tp, message)
    return (reduces * allreduce_ms(hardware, efficiency, tp, message) + moe * block
            + qk_norm_allreduce_ms(model, hardware, efficiency, tp, tokens))


def qk_norm_allreduce_ms(model: ModelFacts, hardware: HardwareFacts, efficiency: EngineEfficiency, tp: int,
                         tokens: int) -> float:
    """The q/k norm's all-reduce of a step of `tokens` tokens where it spans all heads (ModelFacts.qk_norm_allreduce):
    each token's q and k variances, two fp32 numbers, over the TP ranks in every block."""
    if not model.qk_norm_allreduce or tp <= 1:
        return 0.0
    return model.layers * allreduce_ms(hardware, efficiency, tp, tokens * 2 * 4)


def tpot_ms(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int, batch: int,
            input_tokens: int, output_tokens: int, dp: int = 1, kv_dtype: str | None = None,
            ep: bool = False) -> float:
    """Time per output token at `batch` sequences, context averaged over the generation. `dp` > 1: an
    MoE model with data-parallel attention and expert parallelism (vLLM --data-parallel-size with
    --enable-expert-parallel): `batch` is one DP group's, and every group steps together. `kv_dtype`: the
    KV cache's dtype where it is not the compute dtype (an fp8 KV cache). `ep`: expert parallelism at one DP
    group (whole experts on each TP rank); with either, the busiest rank's experts set the step."""
    efficiency = efficiency_for(engine, model, hardware, dtype)
    act = compute_dtype(dtype, model, hardware)
    expert_ranks = tp * dp if ep or dp > 1 else 1
    weights = dp_weight_bytes(decode_weight_bytes(model, engine, dtype, tp, hardware), model, dp, batch * dp,
                              expert_ranks)
    if model.is_encoder_decoder:
        context = input_tokens + output_tokens / 2  # cross-attention over the input + self-attention so far
    else:
        context = input_tokens + output_tokens / 2
    # Sliding-window layers read at most their window of each sequence.
    kv = batch * kv_sequence_bytes(model, tp, kv_dtype or act, math.ceil(context))
    memory_ms = (weights + kv) / effective_bandwidth(hardware, efficiency, tp, dp) * 1e3
    flops = 2 * active_decode_parameters(model) / tp * batch
    flops += 4 * batch * context * model.attention_heads * model.head_dim * model.layers / tp
    compute_ms = flops / (rank_tflops(hardware, act, tp, dp) * 1e12 * decode_compute(efficiency)) * 1e3
    comm_ms = _dp_comm_ms(model, hardware, efficiency, tp, dp, batch, act)
    return memory_ms + compute_ms + comm_ms + fixed_ms(efficiency, model.layers) + moe_floor_ms(efficiency, model,
                                                                                               batch * dp)


def decode_compute(efficiency: EngineEfficiency) -> float:
    """Share of peak TFLOPS a decode step's GEMMs reach (prefill_compute unless the engine says otherwise)."""
    return efficiency.prefill_compute if efficiency.decode_compute is None else efficiency.decode_compute


def fixed_ms(efficiency: EngineEfficiency, layers: int) -> float:
    """What one forward pass pays whatever the TP degree: step overhead + per-layer launches."""
    return efficiency.step_overhead_ms + layers * efficiency.layer_overhead_ms


def moe_floor_ms(efficiency: EngineEfficiency, model: ModelFacts, tokens: int) -> float:
    """What a decode step's MoE blocks cost beyond their experts' bytes (engines.toml, moe_layer_overhead_ms): their
    kernels' minimum times, which show while the step touches few experts and hide behind the expert weights'
    reads as it touches more (scaled by the share of experts `tokens` routed tokens leave untouched)."""
    return moe_layer_count(model) * efficiency.moe_layer_overhead_ms * (1 - _moe_touched_share(model, tokens))


def ttft_ms(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
            input_tokens: int, dp: int = 1) -> float:
    """Time to first token for one prompt of `input_tokens`: the prefill, then its first token.

    Compute-bound: the prompt's FLOPs at the engine's prefill_compute share of peak, plus one read of
    the rank's weights (summed, as in decode), the all-reduces of input·hidden activations and the
    fixed per-pass cost. `dp` > 1 (data-parallel attention, expert parallelism): the prompt's attention
    runs on its group's TP ranks, its experts' work is spread over all tp × dp ranks.
    """
    efficiency = efficiency_for(engine, model, hardware, dtype)
    act = compute_dtype(dtype, model, hardware)
    active = active_prefill_parameters(model)
    if dp > 1 and model.num_experts > 1:
        experts = model.routed_experts * model.experts_per_token / model.num_experts
        active = active - experts + experts / dp
    flops = 2 * active * input_tokens / tp
    blocks = model.encoder_layers if model.is_encoder_decoder else model.layers
    # Q·K and scores·V: 4·s²·heads·head_dim per block, halved where fused kernels skip the masked half;
    # engines that materialize the score matrix (Neuron context encoding, eager CPU) compute all of it.
    causal_share = 1.0 if materializes_attention_scores(engine, hardware) else 0.5
    flops += 4 * causal_share * input_tokens * input_tokens * model.attention_heads * model.head_dim * blocks / tp
    compute_ms = flops / (rank_tflops(hardware, act, tp, dp) * 1e12 * efficiency.prefill_compute) * 1e3
    weights = dp_weight_bytes(weight_bytes(model, engine, dtype, tp, hardware), model, dp)
    memory_ms = weights / effective_bandwidth(hardware, efficiency, tp, dp) * 1e3
    if dp > 1:
        comm_ms = _dp_comm_ms(model, hardware, efficiency, tp, dp, input_tokens, act, gathered=input_tokens)
    else:
        message = input_tokens * model.hidden_size * DTYPE_BYTES[act]
        comm_ms = (2 * blocks * allreduce_ms(hardware, efficiency, tp, message)
                   + qk_norm_allreduce_ms(model, hardware, efficiency, tp, input_tokens))
    prefill = compute_ms + memory_ms + comm_ms + fixed_ms(efficiency, blocks) + efficiency.prefill_overhead_ms
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
            batch: int, input_tokens: int, output_tokens: int, dp: int = 1) -> Timing:
    """Every predicted figure for one configuration (`dp` > 1: each replica is `dp` groups of `tp` ranks,
    `batch` sequences each; see tpot_ms)."""
    tpot = tpot_ms(model, hardware, engine, dtype, tp, batch, input_tokens, output_tokens, dp)
    ttft = ttft_ms(model, hardware, engine, dtype, tp, input_tokens, dp)
    per_instance = max(hardware.devices // (tp * dp), 1)
    span = copy_instances(hardware, tp * dp)  # > 1: the dp groups of a copy span instances
    instances = math.ceil(replicas / per_instance) * span
    throughput = replicas * dp * batch / tpot * 1e3
    # Each rank reads what it holds: with expert parallelism, 1/dp of the experts; an instance loads its
    # own ranks (its share of the groups where they span instances).
    load = load_seconds(model, hardware, engine, dtype, tp, max(min(replicas, per_instance) * dp // span, 1)) * (
        dp_weight_bytes(1.0, model, dp) if dp > 1 else 1.0)
    cost_hour, cost_million = cost_figures(hardware, instances, throughput)
    return Timing(ttft, tpot, throughput, load, cost_hour, cost_million, instances)


def cost_figures(hardware: HardwareFacts, instances: int, throughput: float) -> tuple[float | None, float | None]:
    """USD per hour for `instances`, and per million tokens at `throughput` tokens/s (None, None without a price)."""
    if hardware.price_per_hour is None:
        return None, None
    cost_hour = hardware.price_per_hour * instances
    return cost_hour, cost_hour / (throughput * 3600) * 1e6


__all__ = [
    "Timing", "WEIGHT_ONLY", "active_decode_parameters", "allgather_ms", "allreduce_ms", "allreduce_us",
    "custom_allreduce_us",
    "cost_figures", "copy_instances", "dp_weight_bytes", "efficiency_for", "expert_imbalance", "load_seconds", "moe_layer_count", "predict", "send_us",
    "tpot_ms", "ttft_ms",
]
