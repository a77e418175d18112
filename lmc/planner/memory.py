"""Memory per device: weights, KV cache, prefill activations, runtime overhead. Pure integer bytes.

The rules (docs/planner.md has the derivations):

- Parameters split into the input embedding (vocab·hidden, replicated on every rank), the LM head
  (vocab·hidden when untied; split by vocabulary when the engine shards it and the vocabulary
  divides by TP, else replicated; a tied head is the embedding and costs nothing more), small
  replicated tensors (norms, biases, routers: ~4·hidden per block) and the rest, which TP splits.
- Key/value projections keep heads whole: when TP exceeds the kv heads (GQA/MQA) each rank holds
  ceil(kv_heads/TP) heads, so K/V weights and the KV cache are replicated, not split.
- int8/fp8 weight-only: split matrices take 1 byte per element plus one 16-bit scale per output
  channel (elements/hidden scales); the embedding and LM head stay in the 16-bit compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmc.planner.facts import DTYPE_BYTES, EngineEfficiency, EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.plan import MemoryPerDevice

WEIGHT_ONLY = ("int8", "fp8", "int4", "mxfp4")


@dataclass(frozen=True)
class ParamSplit:
    """Parameter counts by how tensor parallelism treats them."""

    embedding: int  # input embedding rows, replicated
    lm_head: int  # untied LM head (0 when tied to the embedding)
    replicated: int  # norms, biases, routers
    sharded: int  # everything TP splits: attention and MLP matrices (experts included)
    kv_projection: int  # the K and V projections inside `sharded` (kept whole per head)


def param_split(model: ModelFacts) -> ParamSplit:
    embedding = model.vocab_size * model.hidden_size
    lm_head = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    blocks = model.layers + model.encoder_layers
    replicated = blocks * 4 * model.hidden_size + model.hidden_size
    if model.num_experts > 1:  # routers
        replicated += (model.layers if model.moe_layers is None else model.moe_layers) * model.num_experts * model.hidden_size
    sharded = max(model.parameters - embedding - lm_head - replicated, 0)
    attention_blocks = model.layers + model.encoder_layers + (model.layers if model.is_encoder_decoder else 0)
    kv_projection = min(attention_blocks * 2 * model.hidden_size * model.kv_heads * model.head_dim, sharded)
    return ParamSplit(embedding, lm_head, replicated, sharded, kv_projection)


def compute_dtype(dtype: str, model: ModelFacts, hardware: HardwareFacts) -> str:
    """The dtype activations, the KV cache and weight-only-quantized matmuls run in."""
    if dtype not in WEIGHT_ONLY:
        return dtype
    if "bf16" in hardware.dtypes and (model.torch_dtype == "bf16" or "fp16" not in hardware.dtypes):
        return "bf16"
    if "fp16" in hardware.dtypes:
        return "fp16"
    return "fp32"


def kv_heads_per_device(model: ModelFacts, tp: int) -> int:
    """KV heads one rank holds: kv_heads/TP when TP divides them, else ceil (replicated heads)."""
    if model.kv_heads % tp == 0:
        return model.kv_heads // tp
    return math.ceil(model.kv_heads / tp)


def kv_bytes_per_token(model: ModelFacts, tp: int, kv_dtype: str) -> int:
    """KV cache bytes per token per device, over every layer: 2·layers·(kv_heads/TP)·head_dim·bytes;
    under MLA the compressed latent and the rotary key, layers·(kv_lora_rank + qk_rope_head_dim)·bytes,
    which vLLM keeps whole on every TP rank (its MLA cache has one "head")."""
    if model.kv_lora_rank:
        return int(model.layers * (model.kv_lora_rank + model.qk_rope_head_dim) * DTYPE_BYTES[kv_dtype])
    return int(2 * model.layers * kv_heads_per_device(model, tp) * model.head_dim * DTYPE_BYTES[kv_dtype])


def kv_sequence_bytes(model: ModelFacts, tp: int, kv_dtype: str, tokens: int, block: int = 1,
                      in_flight: int = 0) -> int:
    """KV bytes one sequence of `tokens` holds per device, in `block`-token pages per layer: full-attention
    layers keep every token; a sliding-window layer the window's last window−1 tokens plus the tokens
    scheduled but not yet settled (`in_flight`), never more than the sequence, and one page more (the
    window need not start at a page boundary): vLLM's SlidingWindowSpec.max_admission_blocks_per_request.
    With `block` 1 (what attention reads, or a cache without pages) a sliding layer holds its window."""
    per_layer = kv_bytes_per_token(model, tp, kv_dtype) / model.layers
    pages = -(-tokens // block)
    sliding = model.sliding_window_layers if model.sliding_window else 0
    window_pages = 0
    if sliding and block == 1:  # tokens, not pages: the window itself
        window_pages = min(model.sliding_window, tokens)
    elif sliding:
        window_pages = -(-min(model.sliding_window - 1 + in_flight, tokens) // block) + 1
    return int(per_layer * block * ((model.layers - sliding) * pages + sliding * window_pages))


def kv_cache_bytes(model: ModelFacts, tp: int, kv_dtype: str, batch: int, input_tokens: int, output_tokens: int) -> int:
    """KV cache reserved per device for `batch` sequences at full length.

    Decoder-only: batch·(input+output)·kv_bytes_per_token. T5: the decoder's self-attention KV over
    the output, the cross-attention KV over the input (same per-token size), and the encoder output
    (batch·input·hidden, replicated) that the cross-attention keys are computed from.
    """
    per_token = kv_bytes_per_token(model, tp, kv_dtype)
    if model.is_encoder_decoder:
        encoder_out = batch * input_tokens * model.hidden_size * int(DTYPE_BYTES[kv_dtype])
        return batch * (output_tokens + input_tokens) * per_token + encoder_out
    return batch * kv_sequence_bytes(model, tp, kv_dtype, input_tokens + output_tokens)


def lm_head_sharded(model: ModelFacts, engine: EngineFacts, tp: int) -> bool:
    return tp > 1 and engine.shards_lm_head and not model.tie_word_embeddings and model.vocab_size % tp == 0


def _split_elements(model: ModelFacts, split: ParamSplit, tp: int) -> float:
    """Elements of the TP-split matrices one rank holds (K/V replicated per whole head)."""
    kv_share = kv_heads_per_device(model, tp) / model.kv_heads
    return (split.sharded - split.kv_projection) / tp + split.kv_projection * kv_share


def _checkpoint_quantized(model: ModelFacts, engine: EngineFacts, dtype: str, tp: int,
                          hardware: HardwareFacts, decode: bool) -> float:
    """Weight bytes on one rank of a checkpoint served in its own quantization: the embedding,
    norms and (unsplit) LM head at 16 bits, the rest of the checkpoint's bytes split by TP. A decode
    step reads all of it but the embedding (and the tied embedding as LM head)."""
    split = param_split(model)
    plain = DTYPE_BYTES[compute_dtype(dtype, model, hardware)]
    assert model.checkpoint_weight_bytes is not None
    embedding, replicated, head = split.embedding * plain, split.replicated * plain, split.lm_head * plain
    rest = max(model.checkpoint_weight_bytes - embedding - replicated - head, 0) / tp
    head = head / tp if lm_head_sharded(model, engine, tp) else head
    if decode:
        return rest + (head if split.lm_head else embedding)
    return rest + embedding + replicated + head


def weight_bytes(model: ModelFacts, engine: EngineFacts, dtype: str, tp: int, hardware: HardwareFacts) -> int:
    """Weight bytes one rank holds, in the planned dtype (a quantized checkpoint: in its own)."""
    if dtype == model.checkpoint_quantization and model.checkpoint_weight_bytes:
        return int(_checkpoint_quantized(model, engine, dtype, tp, hardware, decode=False))
    split = param_split(model)
    head_dtype = compute_dtype(dtype, model, hardware)
    matrix = _split_elements(model, split, tp)
    total = matrix * DTYPE_BYTES[dtype]
    if dtype in WEIGHT_ONLY:
        total += matrix / model.hidden_size * DTYPE_BYTES[head_dtype]  # per-output-channel scales
    total += split.replicated * DTYPE_BYTES[head_dtype]
    total += split.embedding * DTYPE_BYTES[head_dtype]
    lm_head = split.lm_head / tp if lm_head_sharded(model, engine, tp) else split.lm_head
    total += lm_head * DTYPE_BYTES[head_dtype]
    return int(total)


def decode_weight_bytes(model: ModelFacts, engine: EngineFacts, dtype: str, tp: int, hardware: HardwareFacts) -> float:
    """Weight bytes one decode step reads on one rank.

    Everything except the input embedding (a row lookup), plus the tied embedding as LM head. For an
    encoder-decoder model only the decoder's share of the matrices; for MoE, see `latency`.
    """
    if dtype == model.checkpoint_quantization and model.checkpoint_weight_bytes:
        return _checkpoint_quantized(model, engine, dtype, tp, hardware, decode=True)
    split = param_split(model)
    head_dtype = compute_dtype(dtype, model, hardware)
    matrix = _split_elements(model, split, tp) * decoder_share(model)
    total = matrix * DTYPE_BYTES[dtype]
    if dtype in WEIGHT_ONLY:
        total += matrix / model.hidden_size * DTYPE_BYTES[head_dtype]
    head = split.lm_head if split.lm_head else split.embedding
    head = head / tp if lm_head_sharded(model, engine, tp) else head
    return total + head * DTYPE_BYTES[head_dtype]


def decoder_share(model: ModelFacts) -> float:
    """Share of the split matrices in the decoder (1 for decoder-only).

    A T5 encoder block holds self-attention (4·d·inner) and a gated MLP (3·d·ff); a decoder block
    adds cross-attention (another 4·d·inner).
    """
    if not model.is_encoder_decoder or model.encoder_layers == 0:
        return 1.0
    inner = model.attention_heads * model.head_dim
    attention = 4 * model.hidden_size * inner
    mlp = 3 * model.hidden_size * model.intermediate_size
    encoder = model.encoder_layers * (attention + mlp)
    decoder = model.layers * (2 * attention + mlp)
    return decoder / (encoder + decoder)


def materializes_attention_scores(engine: EngineFacts, hardware: HardwareFacts) -> bool:
    """Whether a prefill holds a full [heads, s, s] score matrix per layer.

    GPU engines run fused/SDPA attention (flash or memory-efficient kernels) that never materialize
    it; transformers-neuronx context encoding and eager CPU attention do.
    """
    return hardware.kind in ("cpu", "neuron")


def activation_bytes(model: ModelFacts, engine: EngineFacts, hardware: HardwareFacts, tp: int, act_dtype: str,
                     batch: int, input_tokens: int) -> int:
    """Peak activations of a prefill of `batch` prompts of `input_tokens`, one layer live at a time.

    tokens·(2·hidden [residual + normed input] + (heads/TP + 2·kv_heads/TP)·head_dim [QKV]
    + 2·experts_per_token·intermediate/TP [MLP up and gate]) · dtype bytes, plus the score matrix
    batch·(heads/TP)·input² where attention materializes it, plus fp32 logits of the last position
    (batch·vocab/TP when the head is split, else batch·vocab).
    """
    size = DTYPE_BYTES[act_dtype]
    tokens = batch * input_tokens
    heads_local = max(model.attention_heads // tp, 1)
    qkv = (heads_local + 2 * kv_heads_per_device(model, tp)) * model.head_dim
    mlp = 2 * model.experts_per_token * model.intermediate_size / tp
    per_token = 2 * model.hidden_size + qkv + mlp
    total = tokens * per_token * size
    if materializes_attention_scores(engine, hardware):
        total += batch * heads_local * input_tokens * input_tokens * size
    vocab_local = model.vocab_size / tp if lm_head_sharded(model, engine, tp) else model.vocab_size
    total += batch * vocab_local * 4
    return int(total)


def overhead_bytes(efficiency: EngineEfficiency, tp: int) -> int:
    """CUDA context / Neuron runtime, plus collective buffers when TP > 1."""
    return efficiency.runtime_overhead_bytes + (efficiency.comm_buffer_bytes if tp > 1 else 0)


# lmc's decode loop (lmc.runtime.engines.paged.PagedCache): a pool of 64 blocks per layer at first, doubled
# whenever a row needs a block the pool lacks; tests check these equal the runtime's.
PAGED_FIRST_BLOCKS = 64
PAGED_BLOCK_TOKENS = 16
# Engines whose KV cache is lmc's decode loop over transformers' modules (PagedCache for continuous batching,
# transformers' DynamicCache for dynamic batches), on PyTorch's CUDA caching allocator.
DECODE_LOOP_ENGINES = ("hf", "deepspeed")


def paged_pool_blocks(needed_blocks: int) -> int:
    """The PagedCache's capacity once it holds `needed_blocks`: 64 doubled until it does."""
    capacity = PAGED_FIRST_BLOCKS
    while capacity < needed_blocks:
        capacity *= 2
    return capacity


def kv_reserve_bytes(model: ModelFacts, tp: int, kv_dtype: str, batch: int, input_tokens: int,
                     output_tokens: int, kv: int) -> int:
    """What PyTorch's CUDA caching allocator holds for the KV cache of lmc's decode loop, `kv` (the live
    cache) included. The allocator keeps every freed block for reuse and returns none to the driver
    (torch.cuda.empty_cache aside), and a freed block serves only requests no larger than itself:

    - continuous batching (PagedCache): each layer's pool grows by allocating the doubled pool, copying,
      then freeing the old one, so a layer holds 64·(1 + 2 + … + 2^k) = 2·capacity − 64 blocks of pools,
      each freed one too small for every later growth;
    - dynamic batches (transformers' DynamicCache): every decode step replaces each layer's keys and values
      by a torch.cat one token longer, allocated while the old tensor is live; the freed block is too small
      for the next step's, so a second cache's worth stays reserved beside the live one: 2·kv.

    The larger of the two (the scheduling is chosen after memory), over every layer."""
    per_row = -(-(input_tokens + output_tokens) // PAGED_BLOCK_TOKENS)
    capacity = paged_pool_blocks(batch * per_row)
    pools = (2 * capacity - PAGED_FIRST_BLOCKS) * PAGED_BLOCK_TOKENS * kv_bytes_per_token(model, tp, kv_dtype)
    return max(pools, 2 * kv)


def decode_gather_bytes(kv: int, layers: int) -> int:
    """A decode step's attention reads each row's keys and values gathered out of the pool
    (PagedCache.update: index_select of every row's positions, padded to the longest): one layer's
    K and V for the batch at full length, live beside the cache while that layer attends."""
    return -(-kv // layers)


def runtime_overhead_bytes(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts,
                           efficiency: EngineEfficiency, tp: int, kv_dtype: str, batch: int, input_tokens: int,
                           output_tokens: int, kv: int) -> int:
    """The engine's fixed overhead (CUDA context, workspaces, collective buffers: `overhead_bytes`) and, for
    lmc's decode loop on a GPU, what the caching allocator reserves beyond the live KV cache and the
    decode's gathered K/V (docs/planner.md, "runtime overhead")."""
    overhead = overhead_bytes(efficiency, tp)
    if hardware.kind != "gpu" or engine.name not in DECODE_LOOP_ENGINES or model.is_encoder_decoder:
        return overhead
    slack = kv_reserve_bytes(model, tp, kv_dtype, batch, input_tokens, output_tokens, kv) - kv
    return overhead + slack + decode_gather_bytes(kv, model.layers)


def host_share(hardware: HardwareFacts, tp: int) -> int:
    """How many TP ranks share one device's memory, bandwidth and compute: on a CPU host all of them
    (the ranks are processes on the same cores and memory); on accelerators each rank has its own."""
    return tp if hardware.kind == "cpu" else 1


def capacity_bytes(hardware: HardwareFacts, memory_fraction: float, memory_per_device: int | None) -> int:
    """What the plan may fill per device: min(device memory · fraction, the absolute cap)."""
    capacity = int(hardware.device_memory_bytes * memory_fraction)
    if memory_per_device is not None:
        capacity = min(capacity, memory_per_device)
    return capacity


def memory_per_device(model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts, efficiency: EngineEfficiency,
                      dtype: str, tp: int, batch: int, input_tokens: int, output_tokens: int,
                      memory_fraction: float, memory_cap: int | None) -> MemoryPerDevice:
    """The full per-device breakdown for one configuration (all integers, bytes)."""
    act_dtype = compute_dtype(dtype, model, hardware)
    weights = weight_bytes(model, engine, dtype, tp, hardware)
    kv = kv_cache_bytes(model, tp, act_dtype, batch, input_tokens, output_tokens)
    activations = activation_bytes(model, engine, hardware, tp, act_dtype, batch, input_tokens)
    overhead = runtime_overhead_bytes(model, hardware, engine, efficiency, tp, act_dtype, batch, input_tokens,
                                      output_tokens, kv)
    total = weights + kv + activations + overhead
    capacity = capacity_bytes(hardware, memory_fraction, memory_cap) // host_share(hardware, tp)
    return MemoryPerDevice(weights=weights, kv_cache=kv, activations=activations, runtime_overhead=overhead,
                           total=total, capacity=capacity, headroom=capacity - total)
