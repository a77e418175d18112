"""Scheduling for the hf and DeepSpeed engines: dynamic or continuous batching, and the KV pool.

Pure: the chosen configuration's facts in, (scheduling, KvCache or None, the decision's reason) out.
vLLM plans are always continuous and size their own pool (engine "vllm" is not decided here).
"""

from __future__ import annotations

from lmc.planner.facts import EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.memory import compute_dtype, kv_bytes_per_token
from lmc.planner.plan import KvCache, MemoryPerDevice

BLOCK_SIZE = 16  # tokens per KV block (vLLM's default)


def choose_scheduling(engine: EngineFacts, dtype: str, tp: int, batch: int, concurrency: int, sequence_tokens: int,
                      model: ModelFacts, hardware: HardwareFacts, memory: MemoryPerDevice, pipeline_stages: int = 1
                      ) -> tuple[str, KvCache | None, str]:
    """("dynamic" | "continuous", the KV pool of a continuous plan, why)."""
    why_not = _dynamic_because(engine, tp, model, hardware, concurrency, pipeline_stages)
    if why_not:
        return "dynamic", None, why_not
    pool = kv_pool(dtype, tp, sequence_tokens, model, hardware, memory)
    running = min(batch, pool.max_concurrent_sequences)
    grown = min(pool.blocks, running * -(-sequence_tokens // BLOCK_SIZE))
    return "continuous", pool, (
        f"{concurrency} concurrent requests: with dynamic batching a request that arrives while a batch decodes "
        f"waits for its longest answer; continuous batching lets it join at the next decode step (its prompt "
        f"prefilled between steps) and lets each finished request leave at once, up to {batch} running "
        f"sequences; the memory left after weights, activations and runtime overhead holds "
        f"{pool.blocks} blocks of {pool.block_size} tokens, {pool.max_concurrent_sequences} sequences of "
        f"{sequence_tokens} tokens (a request joins only with blocks for its prompt and max_new_tokens); the "
        f"{running} running sequences hold at most {grown} of them (the kv cache line of memory per device; "
        f"the paged cache doubles as rows join, its spare blocks in the runtime line), the rest stays free")


def schedules_continuously(engine: EngineFacts, tp: int, model: ModelFacts, hardware: HardwareFacts,
                           concurrency: int, pipeline_stages: int = 1) -> bool:
    """Whether choose_scheduling will choose continuous batching (the search's admission needs to know
    before the choice: a continuous batch frees a slot per finished request, a dynamic one all at once)."""
    return _dynamic_because(engine, tp, model, hardware, concurrency, pipeline_stages) is None


def _dynamic_because(engine: EngineFacts, tp: int, model: ModelFacts, hardware: HardwareFacts, concurrency: int,
                     pipeline_stages: int) -> str | None:
    why_not = _continuous_unavailable(engine, tp, model, hardware)
    if not why_not and pipeline_stages > 1:
        why_not = (f"{pipeline_stages} pipeline stages hand whole batches from one instance to the next; "
                   "batches form dynamically")
    if not why_not and concurrency < 2:
        why_not = ("workload.concurrency = 1: no request can arrive while another decodes, so "
                   "joining a running batch would gain nothing; batches form dynamically")
    return why_not


def _continuous_unavailable(engine: EngineFacts, tp: int, model: ModelFacts, hardware: HardwareFacts) -> str | None:
    if engine.name not in ("hf", "deepspeed"):
        return f"the {engine.name} engine runs compiled batch sizes; batches form dynamically"
    if model.family not in engine.families:
        return (f"lmc's decode loop has no per-sequence layout for {model.family} (it has one for "
                f"{', '.join(engine.families)}); batches form dynamically")
    if model.is_encoder_decoder:
        return (f"{model.family} is an encoder-decoder: lmc's decode loop merges running rows only for "
                "decoder-only models; batches form dynamically")
    # DeepSpeed's fused kernels (kernel injection: CUDA, TP 1, as lmc.runtime.engines.deepspeed.kernel_injection
    # decides) keep the KV cache in their own workspace, which lmc cannot split per sequence.
    if hardware.kind == "gpu" and tp == 1 and engine.fused(model.family):
        return ("DeepSpeed's fused kernels keep the KV cache in their own workspace, so rows cannot join or "
                "leave it; batches form dynamically")
    return None


def kv_pool(dtype: str, tp: int, sequence_tokens: int, model: ModelFacts, hardware: HardwareFacts,
            memory: MemoryPerDevice) -> KvCache:
    """The per-replica KV pool: the memory per device left after weights, activations and overhead, in
    blocks of BLOCK_SIZE tokens (KV bytes per device for each), and how many full-length sequences it holds."""
    per_block = BLOCK_SIZE * kv_bytes_per_token(model, tp, compute_dtype(dtype, model, hardware))
    free = memory.capacity - memory.weights - memory.activations - memory.runtime_overhead
    blocks = max(0, free // per_block)
    per_sequence = -(-sequence_tokens // BLOCK_SIZE)
    return KvCache(block_size=BLOCK_SIZE, blocks=blocks, max_concurrent_sequences=blocks // per_sequence)
