"""A per-sequence KV cache for continuous batching (generate.RunningBatch): each running sequence holds
blocks of its own in one pool per layer, and a forward packs the rows' tokens into one sequence: rows
of different lengths never pad each other in the cache, and a row that joins or leaves copies nothing.

How it plugs into transformers: the model runs with the attention implementation "lmc_paged",
registered in transformers' AttentionInterface. The model computes q, k, v of the packed tokens as
usual and calls `past_key_values.update`: PagedCache writes the new keys and values into their slots
and returns those of every token the packed rows attend to, gathered row after row. The
attention then keeps each query to its own row, with SDPA and a key mask:

  decode (one new token per row)   each row's keys gathered into a row of the step's longest length,
                                   the positions past the row's own masked
  prefill (prompt chunks of rows)  each row's queries against its own keys only (one SDPA per row:
                                   no row computes scores against another's keys), causal

A forward may carry both (Packed.join): the running rows' decode tokens first, then a chunk of joining
rows' prompts, as vLLM mixes prefill and decode in one batch; a row joining costs its prompt's tokens in
the step's forward, not a forward of its own.

The cache never holds padding and a joining row copies nothing; a decode step's attention reads each
row's own blocks, up to the longest row's length. A segmented softmax (each row over exactly its own
keys, no mask) was tried: on this CPU it ran at 0.83x the padded DynamicCache on the tiny model and
1.17x on a 512-wide one, the gather with SDPA at 1.06x and 1.27x (engine-level, 32 requests at 16 sequences).

Without a `lmc_packed` argument (DecodeLoop.generate: dynamic batching, rows left-padded in a
DynamicCache) the attention and its mask are SDPA's.

A model qualifies when its classes use transformers' AttentionInterface and take position_ids and
logits_to_keep, and its layers attend in full or in a sliding window (the layer's window, which
transformers passes to the attention as `sliding_window`, narrows the mask: a key is seen when its
position is within the window of the query's). GPT-J's and BLOOM's attention is their own code
(GPTJAttention._attn; BloomAttention.forward, with ALiBi biases), which lmc replaces on each layer by
the same computation on the paged layout while a paged forward runs (the layout reaches it through
ACTIVE): GPT-J's scores in fp32, BLOOM's with each head's slope times the key's position in its row.
"""

from __future__ import annotations

import contextvars
import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from transformers.cache_utils import Cache

ATTENTION = "lmc_paged"
BLOCK_SIZE = 16  # when the plan names none (its kv_cache.block_size, planner.scheduling.BLOCK_SIZE, is passed in)
_FIRST_BLOCKS = 64  # the pool's first size in blocks; it doubles when full
# The layout of the paged forward running now (PagedCache.forward), for attention code that transformers does
# not hand lmc_packed to (GPT-J's).
ACTIVE: contextvars.ContextVar = contextvars.ContextVar("lmc_paged_layout", default=None)


@dataclass
class Visible:
    """Which keys each query sees: `mask` [queries, keys], True where seen, and their positions in the row."""
    mask: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # the mask per sliding window (made once)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask, for a sliding-window layer narrowed to the keys within `window` positions of the query
        (transformers' rule: key position > query position - window)."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            near = self.key_positions[None, :] > self.query_positions[:, None] - window
            self.windowed[window] = self.mask & near
        return self.windowed[window]


@dataclass
class Segment:
    """One row's part of a packed prefill: its queries [q0, q1) and keys [k0, k1) in the packed order, and
    which keys each query sees (its row's positions up to its own)."""
    q0: int
    q1: int
    k0: int
    k1: int
    visible: Visible


@dataclass
class Packed:
    """One forward's layout, the same for every layer: where the N packed tokens' keys go and which slots
    the queries read (T). Decode rows come first: one query per row, rows padded to the step's longest
    (S) and masked. Then prefill: each row's queries attend to its own keys only (one Segment per row)."""
    write: torch.Tensor  # [N] slots
    read: torch.Tensor  # [T] slots, row after row; the decode rows' B x S first
    decode_rows: int = 0  # B: the first B queries are decode rows
    visible: Visible | None = None  # decode: [B, S], each row's new token against the step's S positions
    segments: list[Segment] = field(default_factory=list)  # prefill, after the decode rows

    def join(self, prefill: "Packed") -> "Packed":
        """This decode layout with `prefill`'s rows after it, in one forward."""
        queries, keys = self.decode_rows, len(self.read)
        shifted = [Segment(seg.q0 + queries, seg.q1 + queries, seg.k0 + keys, seg.k1 + keys, seg.visible)
                   for seg in prefill.segments]
        return Packed(torch.cat([self.write, prefill.write]), torch.cat([self.read, prefill.read]), self.decode_rows,
                      self.visible, shifted)


def _with_alibi(mask: torch.Tensor, key_positions: torch.Tensor, slopes: torch.Tensor | None) -> torch.Tensor:
    """`mask` [..., queries, keys] as SDPA's attn_mask: the bool mask, or with ALiBi [..., heads, queries, keys]:
    each head's slope times the key's position in its row where seen, -inf elsewhere (BLOOM's biases)."""
    if slopes is None:
        return mask
    bias = slopes[:, None, None] * key_positions.to(slopes.dtype)[None, None, :]  # [H, 1, keys]
    return torch.where(mask.unsqueeze(-3), bias, float("-inf"))


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               lmc_packed: Packed | None = None, alibi_slopes: torch.Tensor | None = None, **kwargs):
    if lmc_packed is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # query [1, H, N, D]; key, value [T, Hkv, D] (PagedCache.update)
    heads, tokens, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    window = kwargs.get("sliding_window")
    gqa = heads != kv_heads
    rows, parts = lmc_packed.decode_rows, []
    if rows:  # one query per row: [B, H, 1, D] against [B, Hkv, S, D]
        visible = lmc_packed.visible
        read = rows * visible.mask.shape[1]
        mask = _with_alibi(visible.mask_for(window)[:, None, :], visible.key_positions, alibi_slopes)
        out = F.scaled_dot_product_attention(
            query[0, :, :rows].transpose(0, 1)[:, :, None, :], key[:read].view(rows, -1, kv_heads, dim).transpose(1, 2),
            value[:read].view(rows, -1, kv_heads, dim).transpose(1, 2),
            attn_mask=mask if alibi_slopes is not None else mask[:, None], scale=scaling, enable_gqa=gqa)
        if not lmc_packed.segments:
            return out.transpose(1, 2).reshape(1, tokens, heads, dim), None
        parts.append(out[:, :, 0].transpose(0, 1)[None])
    # each prefill row's queries against its own keys only: [1, H, n, D] against [1, Hkv, t, D]
    key, value = key.transpose(0, 1)[None], value.transpose(0, 1)[None]
    parts += [F.scaled_dot_product_attention(
        query[:, :, seg.q0:seg.q1], key[:, :, seg.k0:seg.k1], value[:, :, seg.k0:seg.k1],
        attn_mask=_with_alibi(seg.visible.mask_for(window), seg.visible.key_positions, alibi_slopes),
        scale=scaling, enable_gqa=gqa) for seg in lmc_packed.segments]
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return out.transpose(1, 2).reshape(1, tokens, heads, dim), None


def _gptj_attn(module, query, key, value, attention_mask=None):
    """GPTJAttention._attn on the paged layout while a paged forward runs (else GPT-J's own): its scores in
    fp32, as GPT-J computes them. query [1, H, N, D]; key, value [T, H, D] (PagedCache.update)."""
    packed = ACTIVE.get()
    if packed is None:
        return type(module)._attn(module, query, key, value, attention_mask)
    out, _ = _attention(module, query.float(), key.float(), value.float(), None,
                        scaling=1.0 / float(module.scale_attn), lmc_packed=packed)
    return out.to(value.dtype).transpose(1, 2), None  # [1, H, N, D], as _merge_heads takes it


def _bloom_forward(module, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    """BloomAttention.forward on the paged layout while a paged forward runs (else BLOOM's own): ALiBi from each
    key's position in its row (the layer's slopes, this rank's heads), scores and softmax in fp32, then
    BLOOM's output projection and residual dropout-add."""
    packed = ACTIVE.get()
    if packed is None:
        return type(module).forward(module, hidden_states, residual, alibi, attention_mask, layer_past, use_cache,
                                    output_attentions, **kwargs)
    from transformers.models.bloom.modeling_bloom import dropout_add

    query, key, value = module._reshape(module.query_key_value(hidden_states))  # [1, H, N, D] each
    key, value = layer_past.update(key, value, module.layer_idx)  # [T, H, D]
    out, _ = _attention(module, query.float(), key.float(), value.float(), None, scaling=module.inv_norm_factor,
                        lmc_packed=packed, alibi_slopes=module._lmc_alibi_slopes)
    context = out.to(value.dtype).reshape(1, query.shape[2], -1)
    return dropout_add(module.dense(context), residual, module.hidden_dropout, module.training), None


def _enable_bloom(inner) -> bool:
    """Route each BloomAttention's forward through _bloom_forward (and the model's ALiBi tensor, which the paged
    forward does not use, off while it runs); False for other models and for BLOOMs whose output projection
    is split by pretraining_tp."""
    layers = [module for module in inner.modules() if type(module).__name__ == "BloomAttention"]
    if not layers or any(module.pretraining_tp > 1 and module.slow_but_exact for module in layers):
        return False
    transformer = inner.transformer
    build = transformer.build_alibi_tensor  # lmc's TP keeps each rank's heads in it (tp._patch_bloom_alibi)
    # Each head's slope: the bias of position 1 (BLOOM's own rule, for this rank's heads).
    slopes = build(torch.ones(1, 2), inner.config.n_head, torch.float32).view(-1, 2)[:, 1]
    transformer.build_alibi_tensor = lambda mask, heads, dtype: None if ACTIVE.get() is not None else build(
        mask, heads, dtype)
    for module in layers:
        module._lmc_alibi_slopes = slopes.to(module.query_key_value.weight.device)
        module.forward = types.MethodType(_bloom_forward, module)
    return True


def _enable_gptj(inner) -> bool:
    """Route each GPTJAttention's _attn through _gptj_attn; False for other models."""
    layers = [module for module in inner.modules() if type(module).__name__ == "GPTJAttention"]
    if not layers:
        return False
    for module in layers:
        module._attn = types.MethodType(_gptj_attn, module)
    return True


_registered = False


def enable(model) -> bool:
    """Switch `model` (a transformers model, or a wrapper with `.module`) to lmc_paged attention; False where it
    does not qualify (see the module doc), the model left as it was."""
    global _registered
    import inspect

    from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    from transformers.masking_utils import sdpa_mask

    inner = getattr(model, "module", model)
    if getattr(getattr(inner, "config", None), "is_encoder_decoder", False):
        return False
    accepted = set(inspect.signature(inner.forward).parameters)
    if "logits_to_keep" not in accepted:
        return False
    if _enable_bloom(inner):  # (no position_ids: BLOOM's positions are the ALiBi biases lmc computes)
        return True
    if "position_ids" not in accepted:
        return False
    if _enable_gptj(inner):
        return True
    can = getattr(inner, "_can_set_attn_implementation", None)
    if can is None or not can():
        return False
    # Full and sliding-window layers only (the attention gets each layer's window as `sliding_window`),
    # nothing that keeps state of another kind (chunked or linear attention).
    if not all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)
               for layer in DynamicCache(config=inner.config).layers):
        return False
    if not _registered:
        AttentionInterface.register(ATTENTION, _attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # dynamic batches: SDPA's mask
        _registered = True
    if inner.config._attn_implementation != ATTENTION:
        inner.set_attn_implementation(ATTENTION)
    return inner.config._attn_implementation == ATTENTION


class PagedCache(Cache):
    """The pool of KV blocks of `block_size` positions, one pool per layer (allocated at the layer's first
    update, grown when blocks run out); the layout of the coming forward is `packed`."""

    def __init__(self, block_size: int | None = None) -> None:
        super().__init__(layers=[])
        self.block_size = block_size or BLOCK_SIZE
        self.capacity = _FIRST_BLOCKS
        self.free = list(range(self.capacity - 1, -1, -1))
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.packed: Packed | None = None

    def used(self) -> int:
        return self.capacity - len(self.free)

    @contextmanager
    def forward(self, packed: Packed):
        """The coming forward's layout, for update and the attention (ACTIVE), while the block runs."""
        self.packed, token = packed, ACTIVE.set(packed)
        try:
            yield
        finally:
            self.packed = None
            ACTIVE.reset(token)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            grown = max(2 * self.capacity, self.capacity + count)
            self.free[:0] = range(grown - 1, self.capacity - 1, -1)  # popped last: the old ones go first
            self.capacity = grown
        return [self.free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        packed = self.packed
        keys, values = self.keys.get(layer_idx), self.values.get(layer_idx)
        slots = self.capacity * self.block_size
        if keys is None or keys.shape[0] < slots:
            shape = (slots, key_states.shape[1], key_states.shape[3])
            new_keys, new_values = key_states.new_zeros(shape), value_states.new_zeros(shape)
            if keys is not None:
                new_keys[:keys.shape[0]], new_values[:values.shape[0]] = keys, values
            keys, values = self.keys[layer_idx], self.values[layer_idx] = new_keys, new_values
        keys.index_copy_(0, packed.write, key_states[0].transpose(0, 1))
        values.index_copy_(0, packed.write, value_states[0].transpose(0, 1))
        return keys.index_select(0, packed.read), values.index_select(0, packed.read)


class Rows:
    """Running sequences in a PagedCache: each row's blocks and how many positions it holds."""

    def __init__(self, cache: PagedCache):
        self.cache = cache
        self.blocks: list[list[int]] = []
        self.lengths: list[int] = []

    def add(self, lengths: list[int]) -> None:
        """New rows whose first `lengths` positions are about to be written (their prompts)."""
        size = self.cache.block_size
        self.blocks += [self.cache.allocate(-(-length // size)) for length in lengths]
        self.lengths += [0] * len(lengths)

    def extend(self, other: "Rows") -> None:
        self.blocks += other.blocks
        self.lengths += other.lengths

    def keep(self, indices: list[int]) -> None:
        kept = set(indices)
        for i, blocks in enumerate(self.blocks):
            if i not in kept:
                self.cache.release(blocks)
        self.blocks = [self.blocks[i] for i in indices]
        self.lengths = [self.lengths[i] for i in indices]

    def release(self) -> None:
        self.keep([])

    def _slots(self, row: int, start: int, end: int) -> list[int]:
        size, blocks = self.cache.block_size, self.blocks[row]
        return [blocks[p // size] * size + p % size for p in range(start, end)]

    def decode_layout(self, device: torch.device) -> Packed:
        """Each row's next position written; every row's positions so far read, each row padded to the
        longest (S positions, the rest masked)."""
        size = self.cache.block_size
        for blocks, length in zip(self.blocks, self.lengths):
            if length == len(blocks) * size:
                blocks += self.cache.allocate(1)
        count, longest = len(self.lengths), max(self.lengths) + 1
        width = -(-longest // size)
        table = torch.tensor([blocks[:width] + [0] * (width - len(blocks)) for blocks in self.blocks], dtype=torch.long)
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        grid = (table[:, :, None] * size + torch.arange(size)).reshape(count, width * size)[:, :longest]
        mask = torch.arange(longest)[None, :] <= lengths[:, None]
        write = grid[torch.arange(count), lengths]
        self.lengths = [length + 1 for length in self.lengths]
        return Packed(write.to(device), grid.reshape(-1).to(device), count,
                      visible=Visible(mask.to(device), lengths.to(device), torch.arange(longest, device=device)))

    def prefill_layout(self, pieces: list[tuple[int, int]], device: torch.device) -> Packed:
        """Row i's prompt positions pieces[i] = [start, end) written (rows with an empty piece take no part);
        each query sees its row's positions up to its own."""
        write, read, segments = [], [], []
        queries = keys = 0
        for row, (start, end) in enumerate(pieces):
            if end <= start:
                continue
            write += self._slots(row, start, end)
            read += self._slots(row, 0, end)
            query_positions = torch.arange(start, end, device=device)
            key_positions = torch.arange(end, device=device)
            segments.append(Segment(queries, queries + end - start, keys, keys + end, Visible(
                key_positions[None, :] <= query_positions[:, None], query_positions, key_positions)))
            queries, keys = queries + end - start, keys + end
            self.lengths[row] = end
        return Packed(torch.tensor(write, device=device), torch.tensor(read, device=device), segments=segments)
