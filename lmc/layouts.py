"""Tensor-parallel layouts: how each family's checkpoint tensors split across TP ranks.

Shared by the build (which writes one safetensors file per rank) and the runtime (which rebuilds
each rank's modules from its file). Pure: names and shapes in, slices out; no torch.

Kinds:
  column      split dim 0 (output features; weight and bias) in equal contiguous parts.
  kv_column   column over key/value heads, each head kept whole; when TP exceeds the kv heads,
              each head is replicated on TP/kv_heads consecutive ranks (GQA/MQA).
  row         split dim 1 (input features); a bias is replicated and added once after all-reduce.
  vocab       split dim 0 of the LM head (and its bias) when the vocabulary divides by TP, else replicate.
  heads_dim1  split dim 1 (T5 relative attention bias: [buckets, heads]).
  replicate   whole on every rank (embeddings, norms, routers, buffers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["column", "kv_column", "row", "vocab", "heads_dim1", "replicate"]

_LLAMA = [
    (r"\.self_attn\.q_proj\.(weight|bias)$", "column"),
    (r"\.self_attn\.[kv]_proj\.(weight|bias)$", "kv_column"),
    (r"\.self_attn\.o_proj\.weight$", "row"),
    (r"\.mlp\.(gate_proj|up_proj)\.weight$", "column"),
    (r"\.mlp\.down_proj\.weight$", "row"),
    (r"\.block_sparse_moe\.experts\.\d+\.(w1|w3)\.weight$", "column"),
    (r"\.block_sparse_moe\.experts\.\d+\.w2\.weight$", "row"),
    (r"^lm_head\.weight$", "vocab"),
]

LAYOUTS: dict[str, list[tuple[str, Kind]]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "mixtral": _LLAMA,
    "qwen2": _LLAMA,
    "gptj": [
        (r"\.attn\.[qkv]_proj\.weight$", "column"),
        (r"\.attn\.out_proj\.weight$", "row"),
        (r"\.mlp\.fc_in\.(weight|bias)$", "column"),
        (r"\.mlp\.fc_out\.weight$", "row"),
        (r"^lm_head\.(weight|bias)$", "vocab"),
    ],
    "gpt_neox": [
        # The fused QKV is laid out head-major ([heads, 3, head_dim]): contiguous parts keep heads whole.
        (r"\.attention\.query_key_value\.(weight|bias)$", "column"),
        (r"\.attention\.dense\.weight$", "row"),
        (r"\.mlp\.dense_h_to_4h\.(weight|bias)$", "column"),
        (r"\.mlp\.dense_4h_to_h\.weight$", "row"),
        (r"^embed_out\.weight$", "vocab"),
    ],
    "opt": [
        (r"\.self_attn\.[qkv]_proj\.(weight|bias)$", "column"),
        (r"\.self_attn\.out_proj\.weight$", "row"),
        (r"\.fc1\.(weight|bias)$", "column"),
        (r"\.fc2\.weight$", "row"),
        (r"^lm_head\.weight$", "vocab"),
    ],
    "bloom": [
        # Fused QKV, head-major ([heads, 3, head_dim]).
        (r"\.self_attention\.query_key_value\.(weight|bias)$", "column"),
        (r"\.self_attention\.dense\.weight$", "row"),
        (r"\.mlp\.dense_h_to_4h\.(weight|bias)$", "column"),
        (r"\.mlp\.dense_4h_to_h\.weight$", "row"),
        (r"^lm_head\.weight$", "vocab"),
    ],
    "t5": [
        (r"\.(SelfAttention|EncDecAttention)\.[qkv]\.weight$", "column"),
        (r"\.(SelfAttention|EncDecAttention)\.o\.weight$", "row"),
        (r"\.SelfAttention\.relative_attention_bias\.weight$", "heads_dim1"),
        (r"\.DenseReluDense\.(wi|wi_0|wi_1)\.weight$", "column"),
        (r"\.DenseReluDense\.wo\.weight$", "row"),
        (r"^lm_head\.weight$", "vocab"),
    ],
}

_COMPILED = {family: [(re.compile(p), kind) for p, kind in rules] for family, rules in LAYOUTS.items()}


@dataclass(frozen=True)
class Split:
    """The part of a tensor one rank holds: `dim` None means the whole tensor."""

    dim: int | None
    start: int = 0
    stop: int = 0


def has_layout(family: str) -> bool:
    """Whether lmc can split `family` across TP ranks (others are served whole, at TP 1)."""
    return family in _COMPILED


def kind_of(family: str, name: str) -> Kind:
    """The layout kind of checkpoint tensor `name` for `family`: for a family without a layout every
    tensor is whole (`replicate`), which is its TP 1 file (the planner plans no other degree for it)."""
    for pattern, kind in _COMPILED.get(family, ()):
        if pattern.search(name):
            return kind
    return "replicate"


def rank_split(family: str, name: str, shape: tuple[int, ...], rank: int, tp: int, head_dim: int | None = None,
               kv_heads: int | None = None) -> Split:
    """Which slice of tensor `name` (of `shape`) rank `rank` of `tp` holds.

    `head_dim` and `kv_heads` are needed for kv_column tensors. Raises ValueError when the tensor
    does not divide (the planner rejects such TP degrees before any build).
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tensor-parallel degree {tp}")
    kind = kind_of(family, name)
    if tp == 1 or kind == "replicate" or (kind == "row" and len(shape) < 2):
        return Split(None)
    if kind == "vocab":
        return _even(name, shape, 0, rank, tp) if shape[0] % tp == 0 else Split(None)
    if kind == "kv_column":
        if head_dim is None or kv_heads is None:
            raise ValueError(f"{name}: kv_column split needs head_dim and kv_heads")
        if shape[0] != kv_heads * head_dim:
            raise ValueError(f"{name}: dim 0 is {shape[0]}, expected kv_heads·head_dim = {kv_heads}·{head_dim}")
        if kv_heads % tp == 0:
            return _even(name, shape, 0, rank, tp)
        if tp % kv_heads == 0:
            head = rank * kv_heads // tp
            return Split(0, head * head_dim, (head + 1) * head_dim)
        raise ValueError(f"{name}: {kv_heads} kv heads neither divide nor are divided by TP {tp}")
    dim = {"column": 0, "row": 1, "heads_dim1": 1}[kind]
    return _even(name, shape, dim, rank, tp)


def _even(name: str, shape: tuple[int, ...], dim: int, rank: int, tp: int) -> Split:
    size = shape[dim]
    if size % tp:
        raise ValueError(f"{name}: dim {dim} of size {size} does not divide by TP {tp}")
    part = size // tp
    return Split(dim, rank * part, (rank + 1) * part)


def local_shape(shape: tuple[int, ...], split: Split) -> tuple[int, ...]:
    if split.dim is None:
        return tuple(shape)
    out = list(shape)
    out[split.dim] = split.stop - split.start
    return tuple(out)


def shard_path(tp: int, rank: int) -> str:
    """Where rank `rank`'s weights live inside the artifact."""
    return f"shards/tp{tp}/rank{rank}.safetensors"


def _count(value: object, limit: int = 1 << 20) -> int:
    """A positive count read from a plan dict, at most `limit` (1 when absent or not one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= limit else 1


def pipeline_degree(plan: dict) -> int:
    """A plan dict's pipeline-parallel degree (deployment.pipeline_parallel_degree; 1 when absent)."""
    return _count((plan.get("deployment") or {}).get("pipeline_parallel_degree", 1), 1024)


def data_parallel_degree(plan: dict) -> int:
    """A plan dict's vLLM data-parallel degree (vllm.data_parallel_size; 1 when absent)."""
    return _count((plan.get("vllm") or {}).get("data_parallel_size", 1))


def instances_spanned(ranks: int, devices: int, cpu: bool) -> int:
    """Instances one pipeline stage's `ranks` (TP × DP) span: 1 where they fit one instance's `devices`,
    else ranks / devices (vLLM's data-parallel groups across instances, GPUs only). CPU ranks are processes
    sharing one host: always 1. The planner, the deployment files and the runtime all count with this."""
    return 1 if cpu or ranks <= devices else -(-ranks // devices)


# vLLM's all2all backend for data-parallel attention with expert parallelism: its default, an all-gather of
# every group's tokens and a reduce-scatter of the results, which runs on any NCCL transport (EFA too) and is
# what the planner costs (lmc.planner.latency._dp_comm_ms, docs/planner.md). The runtime's engine arguments
# and serving.properties name it, so that a later vLLM's default cannot change it unseen.
VLLM_ALL2ALL_BACKEND = "allgather_reducescatter"


def parallel_layout(tp: int, dp: int = 1, pp: int = 1) -> str:
    """One model copy's parallel layout in words: "TP 8 × PP 2", "DP 16 × TP 1"."""
    return (f"DP {dp} × " if dp > 1 else "") + f"TP {tp}" + (f" × PP {pp}" if pp > 1 else "")


def instances_per_copy(plan: dict) -> int:
    """Instances one model copy of a plan dict runs on: its pipeline stages, each spanning the instances its
    TP × DP ranks fill (instances_spanned)."""
    target = plan.get("target") or {}
    devices = target.get("devices")
    if _count(devices) != devices:  # a plan dict that does not say its devices: within one instance
        return pipeline_degree(plan)
    ranks = _count(plan.get("tensor_parallel_degree")) * data_parallel_degree(plan)
    return pipeline_degree(plan) * instances_spanned(ranks, devices, target.get("accelerator") == "cpu")
