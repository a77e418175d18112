"""vLLM's memory model and continuous-batching predictions. Pure integer bytes; no vllm import.

Memory, per device (vLLM's own accounting, vllm/v1/worker/gpu_worker.py `determine_available_memory`):
    requested = gpu_memory_utilization · device memory
    KV pool   = requested − weights per rank − peak activation of a max_num_batched_tokens step
                − non-torch memory (CUDA context, NCCL) − the CUDA-graph pool
    blocks    = KV pool // (block_size · KV bytes per token per rank)
On CPU vLLM does not profile: the pool is VLLM_CPU_KVCACHE_SPACE GiB per rank (an integer,
vllm/platforms/cpu.py), which the plan sets to the whole GiB the budget leaves per rank.

Predictions at the workload's concurrency, with `running` = the sequences one replica decodes at
once (min(max_num_seqs, concurrency / replicas)); every term is a function of lmc.planner.latency:
    decode  = tpot(running)                        one step of `running` decodes
    prefill = ttft(input) − ttft(1)                what a prompt costs beyond a one-token pass
    joins   = running / output_tokens              prompts joining per step in steady state
    mean step = decode + joins · prefill           → throughput = replicas · running / mean step
    TPOT (p50) = decode, plus one chunk's share of a prefill when most steps carry one
                 (joins · chunks ≥ 0.5)
    TTFT = the prompt in chunks of max_num_batched_tokens − (running − 1) tokens (decodes go first),
           each chunk a prefill step that also carries the running decodes: tpot(running) − tpot(1)

The pool on demand. vLLM logs its "Maximum concurrency" as the pool over what one max_model_len sequence
could hold (`max_concurrent_sequences`: every layer full, a sliding-window layer its window plus a step's
tokens in flight), but it does not reserve that: its scheduler allocates a sequence's blocks as the sequence
grows (vllm/v1/core/kv_cache_manager.py `allocate_slots`), frees a sliding-window layer's blocks once they
fall behind the window (single_type_kv_cache_manager.py `SlidingWindowManager.remove_skipped_blocks`), and
runs up to max_num_seqs (1024 by default on H100/H200-class GPUs, 256 on others: engine/arg_utils.py)
while blocks last; when a step finds none, it preempts the newest running request and recomputes it later.
Spread over their generations, running sequences hold the mean length on average, input + half the output:
`sequences_on_demand` of them fill the pool, and max_num_seqs is set to that (or to the concurrency, if lower):
1.06-1.8x the logged maximum for dense models (8k/1k to 1k/8k tokens), about 2.5x for gpt-oss (half its
layers slide over 128 tokens). Requests of equal lengths that start together grow together, so vLLM's
scheduler runs somewhat fewer and recomputes what it preempts: driven in-process by a closed-loop client
(bench/vllm_pool_on_demand.py), 84-95 % of this figure, with 14-35 % more prompt tokens computed. The serving
model below counts neither (docs/known-gaps.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lmc.planner.facts import DTYPE_BYTES, EngineEfficiency, EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.goals import Admission
from lmc.planner.latency import Timing, copy_instances, cost_figures, dp_weight_bytes, predict
from lmc.planner.memory import (
    capacity_bytes,
    compute_dtype,
    host_share,
    kv_bytes_per_token,
    kv_heads_per_device,
    kv_sequence_bytes,
    lm_head_sharded,
    overhead_bytes,
    weight_bytes,
)
from lmc.planner.lora import lora_step_ms, slot_bytes
from lmc.planner.plan import Decision, KvCache, MemoryPerDevice, VllmConfig
from lmc.planner.speculative import decode_ms as speculative_decode_ms, draft_bytes, proposer_kv_share
from lmc.planner.steps import StepLayout, StepTimes, chunked_prompt_attention_ms, step_times

GIB = 2**30
# Tokens per KV block: vLLM's default on GPU (CacheConfig.DEFAULT_BLOCK_SIZE) and on CPU (the CPU
# platform sets 128 when the user does not choose; vllm/platforms/cpu.py).
BLOCK_SIZE = {"gpu": 16, "cpu": 128}
# Tokens per scheduler step, vLLM's defaults for its OpenAI server (what LMI runs):
# engine/arg_utils.py `_get_default_max_num_batched_tokens`: 8192 on GPUs with ≥ 70 GiB that are not
# A100s (H100/H200 class), 2048 on other GPUs, 2048 per rank on CPU.
BATCHED_TOKENS_LARGE_GPU = 8192
BATCHED_TOKENS = 2048
LARGE_GPU_BYTES = 70 * GIB


def in_flight_tokens(hardware: HardwareFacts, batched_tokens: int) -> int:
    """Tokens scheduled but not yet settled (VllmConfig.max_in_flight_tokens): one step's budget per
    concurrent batch, two on GPUs (async scheduling overlaps them), one on CPU."""
    return batched_tokens * (2 if hardware.kind == "gpu" else 1)


def block_size_for(model: ModelFacts, hardware: HardwareFacts) -> int:
    """Tokens per KV block as vLLM sets them: 16 on GPUs; 128 on CPU, except 16 for MLA, whose CPU
    backend requires it (vllm/platforms/cpu.py, check_and_update_config)."""
    if hardware.kind == "cpu" and not model.kv_lora_rank:
        return BLOCK_SIZE["cpu"]
    return BLOCK_SIZE["gpu"]


@dataclass(frozen=True)
class VllmLayout:
    """What vLLM does with one replica's memory; the plan's kv_cache and vllm sections come from it."""

    block_size: int
    blocks: int  # KV blocks in one rank's pool (each rank holds its share of every block)
    bytes_per_block: int  # per rank
    pool_bytes: int  # the KV pool per rank
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    cpu_kvcache_space_gib: int | None  # VLLM_CPU_KVCACHE_SPACE on CPU plans

    sequence_bytes: int = 0  # KV bytes one max_model_len sequence holds per rank (sliding layers: their window)
    mean_sequence_bytes: int = 0  # KV bytes a running sequence holds per rank on average (sequences_on_demand)
    data_parallel_size: int = 1  # DP attention groups of TP ranks, experts spread over all (MoE); max_num_seqs is per group
    kv_dtype: str = "bf16"  # the KV cache's dtype: the compute dtype, or fp8 (vLLM --kv-cache-dtype fp8)
    auto_kv_sequences: int = 0  # with an fp8 KV cache: the sequences a compute-dtype pool would hold
    expert_parallel: bool = False  # vLLM --enable-expert-parallel (MoE): whole experts per rank (pinned, or DP > 1)

    @property
    def blocks_per_sequence(self) -> int:
        if self.sequence_bytes:
            return -(-self.sequence_bytes // self.bytes_per_block)
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrent_sequences(self) -> int:
        """Sequences of max_model_len tokens the pool holds at once (vLLM's "Maximum concurrency": the pool
        over what one sequence holds in every layer)."""
        if self.sequence_bytes:
            return self.pool_bytes // self.sequence_bytes
        return self.blocks // self.blocks_per_sequence

    @property
    def sequences_on_demand(self) -> int:
        """Sequences the pool runs at once as vLLM fills it (module docstring, "The pool on demand"): each holds
        the workload's mean length, input + half the output (a sliding-window layer: its window and a block),
        in whole blocks. Never fewer than max_concurrent_sequences."""
        if not self.mean_sequence_bytes or not self.bytes_per_block:
            return self.max_concurrent_sequences
        mean_blocks = -(-self.mean_sequence_bytes // self.bytes_per_block)
        return max(self.blocks // mean_blocks, self.max_concurrent_sequences)


def max_num_batched_tokens(hardware: HardwareFacts, tp: int, max_num_seqs: int) -> int:
    """vLLM's default token budget per step for this hardware (never below max_num_seqs, as vLLM requires)."""
    if hardware.kind == "cpu":
        tokens = BATCHED_TOKENS * tp
    elif hardware.device_memory_bytes >= LARGE_GPU_BYTES and not hardware.accelerator.startswith("a100"):
        tokens = BATCHED_TOKENS_LARGE_GPU
    else:
        tokens = BATCHED_TOKENS
    return max(tokens, max_num_seqs)


def gpu_memory_utilization(hardware: HardwareFacts, memory_fraction: float, memory_cap: int | None) -> float:
    """The budget as vLLM's fraction of device memory, rounded down to 1e-4 (never more than the budget)."""
    capacity = capacity_bytes(hardware, memory_fraction, memory_cap)
    return math.floor(round(capacity / hardware.device_memory_bytes * 10_000, 6)) / 10_000


def activation_bytes(model: ModelFacts, engine: EngineFacts, tp: int, act_dtype: str, batched_tokens: int,
                     max_num_seqs: int) -> int:
    """Peak of vLLM's profiling step: `batched_tokens` tokens through one layer at a time, attention
    in paged kernels (no score matrix), then fp32 logits for `max_num_seqs` sampled positions.

    tokens·(2·hidden + (heads/TP + 2·kv_heads/TP)·head_dim + 2·experts_per_token·intermediate/TP)·bytes
    + max_num_seqs·vocab/TP·4 (vocab whole when the head is not split).
    """
    heads_local = max(model.attention_heads // tp, 1)
    qkv = (heads_local + 2 * kv_heads_per_device(model, tp)) * model.head_dim
    mlp = 2 * model.experts_per_token * model.intermediate_size / tp
    per_token = 2 * model.hidden_size + qkv + mlp
    vocab_local = model.vocab_size / tp if lm_head_sharded(model, engine, tp) else model.vocab_size
    return int(batched_tokens * per_token * DTYPE_BYTES[act_dtype] + max_num_seqs * vocab_local * 4)


def runtime_bytes(efficiency: EngineEfficiency, hardware: HardwareFacts, tp: int) -> int:
    """Non-torch memory and collective buffers, plus the CUDA-graph pool on GPUs."""
    graphs = efficiency.graph_memory_bytes if hardware.kind == "gpu" else 0
    return overhead_bytes(efficiency, tp) + graphs


def vllm_memory(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, efficiency: EngineEfficiency,
                dtype: str, tp: int, max_num_seqs: int, input_tokens: int, output_tokens: int,
                memory_fraction: float, memory_cap: int | None, dp: int = 1,
                kv_fp8: bool = False) -> tuple[MemoryPerDevice, VllmLayout]:
    """Per-device memory and the KV pool for `max_num_seqs` sequences of input + output tokens.
    `dp` > 1 (an MoE model, data-parallel attention with expert parallelism): each rank holds its TP
    share of everything but the routed experts, and 1/(tp·dp) of those; each DP group's pool serves its
    own `max_num_seqs`. `kv_fp8`: vLLM --kv-cache-dtype fp8, one byte per cached element.

    When the pool holds them, `kv_cache` is the whole pool (vLLM takes what is left) and the headroom
    is what rounding leaves; when it does not, `kv_cache` is what they need and the headroom is the
    (negative) shortfall, so `headroom >= 0` means "fits" for vLLM as for the other engines.
    """
    act_dtype = compute_dtype(dtype, model, hardware)
    kv_dtype = "fp8" if kv_fp8 else act_dtype
    max_model_len = input_tokens + output_tokens
    batched = max_num_batched_tokens(hardware, tp, max_num_seqs)
    weights = weight_bytes(model, engine, dtype, tp, hardware)
    if dp > 1:
        weights = int(dp_weight_bytes(weights, model, dp))
    # LoRA slots and the speculative proposer are weights to vLLM's profiler: they come out of the KV pool.
    weights += slot_bytes(model, act_dtype, tp, max_num_seqs) + draft_bytes(model, engine, dtype, tp, hardware)
    activations = activation_bytes(model, engine, tp, act_dtype, batched, max_num_seqs)
    runtime = runtime_bytes(efficiency, hardware, tp)
    utilization = gpu_memory_utilization(hardware, memory_fraction, memory_cap)
    block_size = block_size_for(model, hardware)
    # A speculative proposer's attention layers (a draft, an EAGLE-3 head, MTP layers) cache in the same pool.
    kv_scale = 1 + proposer_kv_share(model, tp, kv_dtype)
    bytes_per_block = int(block_size * kv_bytes_per_token(model, tp, kv_dtype) * kv_scale)
    sequence = int(kv_sequence_bytes(model, tp, kv_dtype, max_model_len, block_size,
                                     in_flight_tokens(hardware, batched)) * kv_scale)
    # What a running sequence holds on average: vLLM allocates its blocks as it grows (module docstring).
    mean = int(kv_sequence_bytes(model, tp, kv_dtype, decode_context(input_tokens, output_tokens), block_size,
                                 1) * kv_scale)
    # max_num_seqs sequences at their mean length, and one at max_model_len (vLLM refuses to start without it).
    needed = max(max_num_seqs * -(-mean // bytes_per_block), -(-sequence // bytes_per_block)) * bytes_per_block
    space_gib = None
    if hardware.kind == "cpu":  # each rank allocates VLLM_CPU_KVCACHE_SPACE whole GiB
        capacity = capacity_bytes(hardware, memory_fraction, memory_cap) // host_share(hardware, tp * dp)
        space_gib = max((capacity - weights - activations - runtime) // GIB, 0)
        pool = space_gib * GIB
        needed = max(-(-needed // GIB), 1) * GIB
    else:
        capacity = int(utilization * hardware.device_memory_bytes)
        pool = max(capacity - weights - activations - runtime, 0)
    blocks = pool // bytes_per_block
    layout = VllmLayout(block_size=block_size, blocks=blocks, bytes_per_block=bytes_per_block, pool_bytes=pool,
                        max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=batched,
                        gpu_memory_utilization=utilization, cpu_kvcache_space_gib=space_gib,
                        sequence_bytes=sequence, mean_sequence_bytes=mean, data_parallel_size=dp, kv_dtype=kv_dtype)
    kv = pool if layout.max_concurrent_sequences >= 1 and layout.sequences_on_demand >= max_num_seqs else needed
    total = weights + activations + runtime + kv
    return (MemoryPerDevice(weights=weights, kv_cache=kv, activations=activations, runtime_overhead=runtime,
                            total=total, capacity=capacity, headroom=capacity - total), layout)


def fp8_kv_cache(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, efficiency: EngineEfficiency,
                 dtype: str, tp: int, dp: int, input_tokens: int, output_tokens: int, memory_fraction: float,
                 memory_cap: int | None, sequences: int, pinned: str | None = None) -> tuple[bool, int]:
    """Whether the KV cache is fp8 (vLLM --kv-cache-dtype fp8: e4m3, one byte per element), and the sequences
    a compute-dtype pool would hold. Unpinned, fp8 where the GPU has it (Hopper, Ada, Blackwell) and that pool
    holds fewer than the `sequences` each data-parallel group must run: then the pool decides the concurrency
    and fp8 holds twice as many, for a rounding of K and V that vLLM's documentation ("Quantized KV Cache")
    reports as a small accuracy change. Not unpinned for MLA models, whose fp8 cache vLLM supports with some
    attention backends only."""
    if pinned == "auto" or hardware.kind != "gpu" or "fp8" not in hardware.dtypes:
        return False, 0
    _, layout = vllm_memory(model, hardware, engine, efficiency, dtype, tp, 1, input_tokens, output_tokens,
                            memory_fraction, memory_cap, dp)
    holds = layout.sequences_on_demand
    if pinned == "fp8":
        return True, holds
    return (True, holds) if 0 < holds < sequences and not model.kv_lora_rank else (False, 0)


def running_sequences(max_num_seqs: int, replicas: int, concurrency: int) -> int:
    """Sequences one replica decodes at once at the workload's concurrency."""
    return max(1, min(max_num_seqs, -(-concurrency // replicas)))


def layout_steps(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                 layout: VllmLayout) -> StepTimes:
    """The layout's step times (planner/steps.py chooses the source), on a GPU with its decode steps run as
    vLLM's CUDA graphs run them (GraphPaddedSteps)."""
    steps = step_times(model, hardware, engine,
                       StepLayout(engine.name, dtype, layout.kv_dtype, tp, layout.data_parallel_size,
                                  layout.expert_parallel))
    sizes = graph_sizes(layout, hardware)
    return GraphPaddedSteps(steps, sizes) if sizes else steps


# The largest decode batch vLLM captures as a CUDA graph by default, and the GPUs where it is 1024
# (vllm/config/vllm.py, `_set_cudagraph_sizes`: Blackwell data-centre parts, compute capability 10.x).
GRAPH_CEILING, BLACKWELL_GRAPH_CEILING = 512, 1024
BLACKWELL_DATACENTER = ("b200", "gb200", "b300", "gb300")


def cuda_graph_sizes(max_num_seqs: int, max_num_batched_tokens: int, accelerator: str = "") -> tuple[int, ...]:
    """The decode batch sizes vLLM captures CUDA graphs for by default (vllm/config/vllm.py,
    `_set_cudagraph_sizes`, as vLLM 0.32 has it): 1, 2, 4, every 8 to 248 and every 16 from 256, up to
    min(2 · max_num_seqs, 512 (1024 on Blackwell), max_num_batched_tokens), and max_num_seqs and
    max_num_batched_tokens themselves where they are within that."""
    top = BLACKWELL_GRAPH_CEILING if accelerator.lower().startswith(BLACKWELL_DATACENTER) else GRAPH_CEILING
    ceiling = max(min(2 * max_num_seqs, top, max_num_batched_tokens), 1)
    sizes = {size for size in (1, 2, 4) if size <= ceiling}
    sizes.update(range(8, min(ceiling + 1, 256), 8))
    sizes.update(range(256, ceiling + 1, 16))
    sizes.update(size for size in (max_num_seqs, max_num_batched_tokens) if size <= ceiling)
    return tuple(sorted(sizes))


def graph_sizes(layout: VllmLayout, hardware: HardwareFacts) -> tuple[int, ...]:
    """The decode batches the layout's vLLM captures as CUDA graphs: cuda_graph_sizes on a GPU, none on CPU
    (vLLM runs eager there)."""
    if hardware.kind != "gpu":
        return ()
    return cuda_graph_sizes(layout.max_num_seqs, layout.max_num_batched_tokens, hardware.accelerator)


def graph_batch(sizes: tuple[int, ...], batch: int) -> int:
    """The captured size a decode step of `batch` sequences runs as: the smallest of `sizes` at or above it
    (itself above the largest)."""
    return next((size for size in sizes if size >= batch), batch)


def _graph_padding(layout: VllmLayout, hardware: HardwareFacts, running: int, moe: bool) -> str:
    """The batch_size reason's note where a decode step of `running` runs as a larger CUDA graph."""
    padded = graph_batch(graph_sizes(layout, hardware), running)
    ops = "GEMMs, experts and collectives" if moe else "GEMMs and collectives"
    return (f"; a decode step of {running} runs as vLLM's CUDA graph of {padded} sequences, and its {ops} cost "
            "that many" if padded > running else "")


@dataclass(frozen=True)
class GraphPaddedSteps:
    """A GPU layout's step times with vLLM's CUDA-graph padding. vLLM replays a decode step of `batch`
    sequences as the graph of the smallest captured size at or above it (`cuda_graph_sizes`), the rows
    beyond the batch padding (vllm/v1/worker/gpu_model_runner.py, `_determine_batch_execution_and_padding`):
    every GEMM, MoE block and collective runs at the padded size, while the padded rows have no KV cache for
    attention to read. So a step of `batch` costs the step at `batch` plus what the padded rows add at one
    token of context: decode(padded, 1) − decode(batch, 1). Larger batches than the largest graph run without
    one, unpadded. A mixed step (a prompt's chunk beside the decodes) is padded on its hundreds or thousands of
    tokens to the next multiple of 8 or 16, which is not counted: it stays the wrapped step times', as does
    everything else."""

    steps: StepTimes
    sizes: tuple[int, ...]

    @property
    def source(self) -> str:
        return self.steps.source

    def padded(self, batch: int) -> int:
        """The captured size a decode step of `batch` sequences runs as (itself above the largest)."""
        return graph_batch(self.sizes, batch)

    def decode_ms(self, batch: int, context: int) -> float:
        step = self.steps.decode_ms(batch, context)
        padded = self.padded(max(batch, 1))
        if padded <= batch:
            return step
        return step + max(self.steps.decode_ms(padded, 1) - self.steps.decode_ms(batch, 1), 0.0)

    def prefill_ms(self, tokens: int) -> float:
        return self.steps.prefill_ms(tokens)

    def mixed_ms(self, chunk: int, batch: int, prompt: int, context: int) -> float:
        return self.steps.mixed_ms(chunk, batch, prompt, context)

    def server_ms(self, efficiency: EngineEfficiency, prompt: int) -> float:
        return self.steps.server_ms(efficiency, prompt)


def decode_context(input_tokens: int, output_tokens: int) -> int:
    """A running sequence's context, averaged over its generation (its decode steps' context, and what it
    holds in the pool on average)."""
    return input_tokens + output_tokens // 2


def plain_decode_ms(steps: StepTimes, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str,
                    tp: int, layout: VllmLayout, batch: int, context: int) -> float:
    """One decode step of `batch` sequences before speculation: the step times' decode plus the LoRA kernels."""
    return (steps.decode_ms(batch, context)
            + lora_step_ms(model, hardware, engine, dtype, tp, batch, layout.max_num_seqs, layout.data_parallel_size))


def vllm_predict(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                 replicas: int, layout: VllmLayout, input_tokens: int, output_tokens: int,
                 concurrency: int, steps: StepTimes | None = None) -> Timing:
    """TTFT, TPOT and throughput of continuous batching at the workload's concurrency (module docstring),
    from the layout's step times (`steps`; by default planner/steps.py's choice: aiconfigurator's measured
    data or lmc's roofline).
    With data-parallel attention (layout.data_parallel_size > 1) `running` is one DP group's, each of a
    replica's groups runs as many, and (MoE models) they step together: a prefill in one group delays every
    group's step."""
    dp = layout.data_parallel_size
    groups = replicas * dp
    running = running_sequences(layout.max_num_seqs, groups, concurrency)
    # Fewer requests than groups: `running` is 1 where a group has one, and the others step empty (an MoE
    # model's idle DP groups run dummy batches in lockstep), so the replica serves the requests it has.
    served = min(groups * running, concurrency)
    if steps is None:
        steps = layout_steps(model, hardware, engine, dtype, tp, layout)
    # Instances, load and price per hour as for any engine; the step times are the layout's.
    base = predict(model, hardware, engine, dtype, tp, replicas, running, input_tokens, output_tokens, dp)
    context = decode_context(input_tokens, output_tokens)
    decode = plain_decode_ms(steps, model, hardware, engine, dtype, tp, layout, running, context)
    decode = speculative_decode_ms(model, hardware, engine, dtype, tp, running, input_tokens, output_tokens, dp, decode)

    # Chunked prefill: the scheduler fills a step's token budget with the running decodes first, then
    # prompt tokens. In steady state each running sequence brings its prompt once per output_tokens steps; an
    # MoE model's data-parallel groups step in lockstep (each MoE block gathers every group's tokens), so a
    # prompt joining any group holds up all of them.
    budget = max(layout.max_num_batched_tokens - running, 1)
    chunk = min(input_tokens, budget)
    joins = (served / replicas if model.num_experts > 1 else running) / output_tokens  # prompts per step
    per_prompt_token = max(steps.mixed_ms(chunk, running, input_tokens, context) - decode, 0.0) / chunk
    # A prompt longer than the budget is read in chunks, each attending to the chunks before it.
    prefix = chunked_prompt_attention_ms(steps, input_tokens, chunk)
    # Every step pays its share of the prompts: vLLM's TPOT, (end-to-end − TTFT) / (output − 1) per
    # request, averages over exactly these steps, and throughput is the running sequences over them.
    step = decode + joins * (input_tokens * per_prompt_token + prefix)

    ttft = first_token_ms(steps, engine.efficiency[hardware.kind], running, step, budget, input_tokens,
                          context, joins)
    # A slot serves one request per TTFT + (output − 1) steps: its output over that is the throughput (what a
    # benchmark measures: completed tokens over the run), so requests/s = throughput / output tokens.
    cycle = ttft + (output_tokens - 1) * step
    throughput = served * output_tokens / cycle * 1e3
    slot_ttft = ttft
    waiting = -(-concurrency // groups) - running  # requests per group beyond its running slots
    if waiting > 0:
        ttft = queued_ttft_ms(ttft, step, running, running + waiting, output_tokens)
    _, cost_million = cost_figures(hardware, base.instances_used, throughput)
    return replace(base, ttft_ms=ttft, slot_ttft_ms=slot_ttft, tpot_ms=step, throughput_tokens_per_s=throughput,
                   load_seconds=base.load_seconds + engine.efficiency[hardware.kind].start_seconds,
                   cost_per_million_tokens=cost_million, step_times=steps.source)


def first_token_ms(steps: StepTimes, efficiency: EngineEfficiency, running: int, step: float, budget: int,
                   input_tokens: int, context: int, joins: float) -> float:
    """A prompt's time to first token with a free slot: the server's own work (HTTP, tokenizing, the hop to
    the engine core), half a step's wait for the running step to end (none when nothing runs), then the
    prompt's chunks, each a step that also carries the other running decodes and the other prompts joining
    (`joins` · input tokens a step, steady state) within the step's token budget, its chunks after the first
    with their attention over the ones before (steps.chunked_prompt_attention_ms)."""
    server = steps.server_ms(efficiency, input_tokens)
    others = running - 1
    if others == 0:
        return server + steps.prefill_ms(input_tokens)
    tokens = input_tokens * (1 + joins)  # this prompt and the share of others' that lands beside it
    chunks = max(math.ceil(tokens / budget), 1)
    per_chunk = steps.mixed_ms(min(math.ceil(tokens / chunks), budget), others, input_tokens, context)
    # its chunks after the first attend to the ones before them
    prefix = chunked_prompt_attention_ms(steps, input_tokens, math.ceil(input_tokens / chunks))
    return server + step / 2 + chunks * per_chunk + prefix


def queued_ttft_ms(ttft: float, step: float, running: int, clients: int, output_tokens: int) -> float:
    """TTFT when more requests are in flight than run at once (`clients` per group of `running` slots, a
    closed loop as benchmarks drive it): a slot serves a request every TTFT + (output − 1) steps, so by
    Little's law each client's round trip is clients / running of that, and what is not decoding is
    waiting for its first token."""
    decoding = (output_tokens - 1) * step
    return clients / running * (ttft + decoding) - decoding


def vllm_pipeline_predict(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, dtype: str, tp: int,
                          pp: int, replicas: int, layout: VllmLayout, input_tokens: int, output_tokens: int,
                          concurrency: int) -> Timing:
    """vLLM across `pp` instances (docs/planner.md, "Across instances"): the stages hold 1/pp of the layers
    each and vLLM keeps `pp` micro-batches in flight (one per stage), so the stages work at once instead of
    in turn. max_num_seqs caps the requests its scheduler runs, all micro-batches together (vLLM's V1
    scheduler keeps one running list, `len(self.running) <= max_num_running_reqs`), so they share it. A
    micro-batch's token passes every stage: its TPOT is the whole model's step for the micro-batch plus
    (pp − 1) hand-overs, and a replica's throughput is its running sequences (all micro-batches) over that.
    Each instance loads only its stage."""
    from lmc.planner.scale import hop_ms, instances_for, stage_model

    assert hardware.network is not None  # pipeline_unsupported said so
    running = running_sequences(layout.max_num_seqs, replicas, concurrency)
    micro = -(-running // pp)
    whole = vllm_predict(model, hardware, engine, dtype, tp, 1, layout, input_tokens, output_tokens, micro)
    width = model.hidden_size * DTYPE_BYTES[compute_dtype(dtype, model, hardware)]
    hops = (pp - 1) * hop_ms(hardware.network, micro * width)
    mean_step = micro / whole.throughput_tokens_per_s * 1e3 + hops
    throughput = replicas * running / mean_step * 1e3
    ttft = whole.ttft_ms + (pp - 1) * hop_ms(hardware.network, input_tokens * width)
    load = vllm_predict(stage_model(model, pp), hardware, engine, dtype, tp, 1, layout, input_tokens,
                        output_tokens, micro).load_seconds
    instances = instances_for(replicas, max(hardware.devices // tp, 1), pp)
    cost_hour, cost_million = cost_figures(hardware, instances, throughput)
    return replace(whole, ttft_ms=ttft, slot_ttft_ms=None, tpot_ms=whole.tpot_ms + hops, throughput_tokens_per_s=throughput,
                   load_seconds=load, instances_used=instances, cost_per_hour=cost_hour,
                   cost_per_million_tokens=cost_million)


def plan_layout(plan, model: ModelFacts, hardware: HardwareFacts) -> VllmLayout:
    """A vLLM plan's layout as planned (its vllm and kv_cache sections), to evaluate its serving model again at
    other lengths or concurrencies (lmc measure's comparison, bench/fidelity.py's benchmark runs)."""
    section, kv = plan.vllm, plan.kv_cache
    assert section is not None
    kv_dtype = "fp8" if section.kv_cache_dtype == "fp8" else compute_dtype(plan.dtype, model, hardware)
    return VllmLayout(block_size=kv.block_size if kv else 16, blocks=kv.blocks if kv else 0, bytes_per_block=0,
                      pool_bytes=0, max_num_seqs=section.max_num_seqs, max_model_len=section.max_model_len,
                      max_num_batched_tokens=section.max_num_batched_tokens,
                      gpu_memory_utilization=section.gpu_memory_utilization,
                      cpu_kvcache_space_gib=section.cpu_kvcache_space_gib,
                      data_parallel_size=section.data_parallel_size, kv_dtype=kv_dtype,
                      expert_parallel=section.enable_expert_parallel)


# --- plan sections and decisions --------------------------------------------------------------------

def vllm_quantization(dtype: str, hardware: HardwareFacts) -> str | None:
    """vLLM's name for what the dtype means: fp8 is its online quantization, not lmc's weight-only fp8;
    weight-only (Marlin kernels, 16-bit compute) on a GPU without fp8 compute (Ampere)."""
    if dtype != "fp8":
        return None
    if "fp8" in hardware.dtypes:
        return "fp8 (vLLM --quantization fp8: per-tensor fp8 weights, dynamic fp8 activations)"
    return (f"fp8 weight-only (vLLM --quantization fp8 on {hardware.accelerator}, which has no fp8 compute: "
            "Marlin kernels, 16-bit activations)")


def kv_cache_section(layout: VllmLayout) -> KvCache:
    return KvCache(block_size=layout.block_size, blocks=layout.blocks,
                   max_concurrent_sequences=layout.max_concurrent_sequences)


# vLLM's --dtype spelling of lmc's compute dtypes.
VLLM_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def vllm_section(layout: VllmLayout, model: ModelFacts, hardware: HardwareFacts, dtype: str, spec,
                 admitted: Admission) -> VllmConfig:
    """The engine arguments of a vLLM plan: sizes, the compute dtype and vLLM's quantization flag (fp8 online
    quantization of 16-bit weights; none for a quantized checkpoint, whose quantization_config vLLM reads),
    the admission bound, and the server's parsers (spec.serving)."""
    online_fp8 = dtype == "fp8" and model.checkpoint_quantization is None
    return VllmConfig(max_num_seqs=layout.max_num_seqs, max_model_len=layout.max_model_len,
                      max_num_batched_tokens=layout.max_num_batched_tokens,
                      gpu_memory_utilization=layout.gpu_memory_utilization,
                      cpu_kvcache_space_gib=layout.cpu_kvcache_space_gib,
                      kv_cache_dtype="fp8" if layout.kv_dtype == "fp8" else "auto",
                      dtype=VLLM_DTYPES[compute_dtype(dtype, model, hardware)],
                      quantization="fp8" if online_fp8 else None,
                      enable_expert_parallel=layout.expert_parallel,
                      data_parallel_size=layout.data_parallel_size,
                      max_num_queued_reqs=admitted.bound, retry_after_s=admitted.retry_after_s,
                      tool_call_parser=spec.serving.tool_call_parser, reasoning_parser=spec.serving.reasoning_parser)


def weights_format(hardware: HardwareFacts, remote: bool = False, quantized: str | None = None,
                   data_parallel: int = 1) -> tuple[str, str]:
    """How a vLLM artifact carries its weights, and why (the build follows this; docs/choices.md, "vLLM", has the details)."""
    if data_parallel > 1 and not remote and not quantized:
        return ("checkpoint", f"the checkpoint in the planned dtype: with {data_parallel} data-parallel groups each "
                              "rank loads its part from it (vLLM's sharded_state is written per rank of one "
                              "tensor-parallel group)")
    if quantized and not remote:
        return ("checkpoint", f"the {quantized}-quantized checkpoint as published: vLLM reads its "
                              "quantization_config and partitions it as it loads")
    if remote:
        return ("remote", "model.uri: the container loads the checkpoint from there and vLLM partitions it as it loads")
    if hardware.kind == "cpu":
        return ("checkpoint", "the checkpoint in the planned dtype: vLLM's sharded_state round trip is broken on CPU "
                              "(saving writes only embeddings and norms; loading fails with missing keys)")
    return ("sharded_state", "vLLM's sharded_state files per rank, written by vLLM at build time so loading never "
                             "re-partitions; a build machine without CUDA GPUs for the TP degree cannot run vLLM and "
                             "packs the checkpoint in the planned dtype instead (the build says so)")


def kv_dtype_decision(layout: VllmLayout, hardware: HardwareFacts, spec, running: int, share: str = "") -> Decision:
    """What the KV cache's dtype buys: with fp8, the sequences the pool holds against a compute-dtype pool's.
    `running` is what one pool (a replica's, a data-parallel group's) runs at once, `share` how that comes from the
    workload (running_sequences)."""
    holds = layout.sequences_on_demand
    if layout.kv_dtype == "fp8":
        why = ("pinned by the spec" if spec.pin.kv_cache_dtype == "fp8" else
               f"a {hardware.accelerator} computes in fp8 and a 16-bit pool would run only "
               f"{layout.auto_kv_sequences} sequences at once, fewer than the concurrency asks")
        return Decision(key="kv_cache_dtype", value="fp8", reason=(
            f"{why}: an fp8 cache (vLLM --kv-cache-dtype fp8, e4m3) stores one byte per element, so the pool runs "
            f"{holds} sequences instead of {layout.auto_kv_sequences} and {running} run at once; K and V are "
            "rounded to fp8 as they are stored, a small accuracy cost (vLLM docs, \"Quantized KV Cache\")"))
    if spec.pin.kv_cache_dtype == "auto":
        return Decision(key="kv_cache_dtype", value="auto",
                        reason=f"pinned by the spec: the activations' dtype ({layout.kv_dtype})")
    if hardware.kind != "gpu" or "fp8" not in hardware.dtypes:
        return Decision(key="kv_cache_dtype", value="auto",
                        reason=f"the activations' dtype ({layout.kv_dtype}): {hardware.accelerator} has no fp8 "
                               "for an fp8 KV cache")
    return Decision(key="kv_cache_dtype", value="auto", reason=(
        f"the activations' dtype ({layout.kv_dtype}): the pool runs {holds} sequences at once, enough for the "
        f"{running} it runs{share}; an fp8 cache (pin.kv_cache_dtype = \"fp8\") would hold about twice as many"))


def vllm_decisions(out: list[Decision], spec, model: ModelFacts, hardware: HardwareFacts, layout: VllmLayout,
                   memory: MemoryPerDevice, replicas: int, admitted: Admission, tp: int,
                   in_flight: int = 0) -> list[Decision]:
    """The decisions of a vLLM plan: its own reasons for batch, delay and KV cache, and its engine arguments.
    `in_flight`: the requests the plan's figures are predicted at, where the request rate keeps more in flight
    than the stated concurrency (else the concurrency)."""
    load = spec.workload
    per_token = layout.bytes_per_block // layout.block_size
    groups = replicas * layout.data_parallel_size
    in_flight = max(in_flight, load.concurrency)
    pools = "data-parallel groups" if layout.data_parallel_size > 1 else "replicas"
    running = running_sequences(layout.max_num_seqs, groups, in_flight)
    where = f"{replicas} replica(s)" + (f" of {layout.data_parallel_size} data-parallel groups each (max_num_seqs "
                                        "is per group)" if layout.data_parallel_size > 1 else "")
    at = (f"at concurrency {load.concurrency} over {where}" if in_flight == load.concurrency else
          f"in each of {where}: {load.requests_per_second:g} requests/s keep more in flight than the stated "
          f"concurrency {load.concurrency}, all of them at max_num_seqs ({in_flight}), and the plan's figures are "
          "theirs")
    if hardware.kind == "cpu":
        pool = (f"VLLM_CPU_KVCACHE_SPACE = {layout.cpu_kvcache_space_gib} GiB per rank: what weights, activations "
                f"and runtime leave of the {memory.capacity / GIB:.2f} GiB budget per rank, in whole GiB")
    else:
        pool = (f"{layout.gpu_memory_utilization:g} × {hardware.device_memory_bytes / GIB:.1f} GiB − weights "
                f"{memory.weights / GIB:.2f} GiB − activations {memory.activations / GIB:.2f} GiB − runtime and "
                f"CUDA graphs {memory.runtime_overhead / GIB:.2f} GiB = {layout.pool_bytes / GIB:.2f} GiB")
    replaced = {
        "batch_size": f"max_num_seqs {layout.max_num_seqs}: the pool runs {layout.sequences_on_demand} sequences "
                      f"at the workload's mean length of {decode_context(load.max_input_tokens, load.max_output_tokens)}"
                      f" tokens (vLLM allocates blocks as sequences grow; {layout.max_concurrent_sequences} of "
                      f"{layout.max_model_len} tokens at once); {running} run at once {at}"
                      + _graph_padding(layout, hardware, running, model.num_experts > 1),
        "max_batch_delay_ms": "continuous batching: a request joins the running batch at the next step, no wait",
        "kv_cache": f"{pool}; {layout.blocks} blocks of {layout.block_size} tokens × {per_token / 1024:.1f} KiB per "
                    f"token per rank = {layout.blocks * layout.block_size} tokens"
                    + (f" at every layer's bytes; a sequence's {model.sliding_window_layers} sliding-window layers "
                       f"hold its last {model.sliding_window} tokens and a step's tokens in flight (vLLM's maximum "
                       f"counts up to {layout.max_num_batched_tokens} of them, the on-demand figure a block)"
                       if model.sliding_window_layers and model.sliding_window else "")
                    + f"; {layout.max_concurrent_sequences} sequences of {layout.max_model_len} tokens (vLLM logs the "
                    "pool as their "
                    f"{layout.max_concurrent_sequences * layout.max_model_len} tokens: its maximum concurrency × "
                    f"max_model_len); on demand it runs {layout.sequences_on_demand} at the workload's mean length, "
                    "preempting the newest when a step finds no free block",
    }
    values = {"max_batch_delay_ms": 0}
    out = [Decision(key=d.key, value=values.get(d.key, d.value), reason=replaced.get(d.key, d.reason)) for d in out]
    fmt, why = weights_format(hardware, remote=spec.model.uri is not None, quantized=model.quantization_method
                              if model.checkpoint_quantization else None, data_parallel=layout.data_parallel_size)
    goal_at = next(i for i, d in enumerate(out) if d.key == "goal")
    out[goal_at:goal_at] = [
        Decision(key="scheduling", value="continuous",
                 reason="vLLM schedules every step: finished sequences leave, waiting ones join, prefills are "
                        f"chunked into decode steps of up to {layout.max_num_batched_tokens} tokens"),
        Decision(key="max_model_len", value=layout.max_model_len,
                 reason=f"max_input_tokens {load.max_input_tokens} + max_output_tokens {load.max_output_tokens}"),
        Decision(key="max_num_batched_tokens", value=layout.max_num_batched_tokens,
                 reason="vLLM's default for its OpenAI server on this hardware (tokens per step; longer prompts "
                        "are chunked)"),
        Decision(key="gpu_memory_utilization", value=layout.gpu_memory_utilization,
                 reason="the budget as a share of device memory" if hardware.kind != "cpu" else
                 "the budget's share (vLLM on CPU sizes its KV pool from VLLM_CPU_KVCACHE_SPACE instead)"),
        kv_dtype_decision(layout, hardware, spec, running, share=f" (concurrency {in_flight} over {groups} {pools})"
                          if groups > 1 else ""),
        Decision(key="weights", value=fmt, reason=why),
        Decision(key="admission", value=admitted.bound, reason=admitted.reason),
    ]
    dp = layout.data_parallel_size
    span = copy_instances(hardware, tp * dp)
    across = (f"; the ranks fill {span} instances, so the gathers also cross {hardware.network.name}"
              if span > 1 and hardware.network is not None else "")
    if model.num_experts > 1 and dp > 1:
        out.insert(goal_at + 5, Decision(
            key="expert_parallel", value=True,
            reason=(("pinned by the spec (pin.data_parallel_degree): " if spec.pin.data_parallel_degree else "")
                    + f"data-parallel attention: {dp} groups, each with its own {layout.max_num_seqs} sequences and "
                    f"KV pool; the {model.num_experts} experts spread over all their ranks (vLLM --data-parallel-size "
                    f"{dp} --enable-expert-parallel); per MoE block vLLM's default all2all backend all-gathers every "
                    f"group's tokens and reduce-scatters the results instead of all-reducing{across}")))
    elif dp > 1:
        out.insert(goal_at + 5, Decision(
            key="data_parallel_size", value=dp,
            reason=(f"pinned by the spec: {dp} independent vLLM engines of TP {tp} behind one endpoint (vLLM "
                    f"--data-parallel-size {dp}; its front end balances requests over them), each with its own "
                    f"{layout.max_num_seqs} sequences and KV pool; a dense model's engines never wait for each other")))
    elif model.num_experts > 1:
        ep = bool(spec.pin.expert_parallel)
        out.insert(goal_at + 5, Decision(
            key="expert_parallel", value=ep,
            reason=("pinned by the spec: vLLM places whole experts on each tensor-parallel rank "
                    f"({model.num_experts} experts over the ranks; the same bytes per rank as splitting each, with "
                    "whole-expert GEMMs)") if ep else
            (f"{model.num_experts} experts split across the tensor-parallel ranks (vLLM's default); "
             "pin.expert_parallel = true places whole experts on each rank instead")))
    return out
