"""Ahead-of-time weight partitioning: one safetensors file per tensor-parallel rank, in the planned dtype.

`partition_checkpoint` writes `shards/tp{T}/rank{r}.safetensors` (lmc.layouts.shard_path) under
`out_dir`. Each file holds, under the checkpoint's own tensor names, exactly the slice of every
tensor that lmc.layouts.rank_split gives rank r — the slices the runtime rebuilds its modules from.

Memory stays bounded by the largest tensor, not the model: tensors are processed one at a time,
each mapped alone (lmc.emitters.safetensors_stream.mapped_tensor: zero-copy, unmapped when done),
each rank's slice cast and written at its offset in that rank's file, then dropped. Each source
tensor is read once. Measured by bench/partition_bench.py.

Dtypes (`dtype`, the plan's):
  fp32, fp16, bf16  every floating-point tensor cast to it; integer/bool tensors kept as they are.
  int8              weight-only, per-output-channel symmetric quantization of the 2-D Linear weights
                    that the layout splits (kinds column, kv_column, row): for weight W (out × in),
                    scale[o] = max_i |W[o, i]| / 127 (1 where a row is all zeros), Q = round(W / scale)
                    clamped to [-127, 127], stored as I8 under the original name, with `<name>_scale`
                    holding scale as F32 of shape (out,) — split like W's rows for column kinds, whole
                    for row kinds. The runtime dequantizes W ≈ Q · scale[:, None]. Scales come from the
                    whole tensor, so every TP degree holds the same quantized model. Every other
                    floating-point tensor (embeddings, LM head, norms, biases, routers) is F16.
  fp8               the same with torch.float8_e4m3fn: scale[o] = max |W[o]| / 448, Q = W / scale
                    cast to F8_E4M3 (round to nearest); other floating-point tensors F16.

Header metadata of every file: format=pt, lmc.family, lmc.tp, lmc.rank, lmc.dtype, and for int8/fp8
lmc.quantization = "per-row-symmetric" and lmc.scale_suffix = "_scale".
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from lmc.emitters.checkpoint import CheckpointInfo
from lmc.emitters.safetensors_stream import StreamingWriter, TensorEntry, mapped_tensor
from lmc.errors import CheckpointError, InternalError
from lmc.layouts import Split, has_layout, kind_of, local_shape, rank_split, shard_path

if TYPE_CHECKING:  # pragma: no cover
    import torch

SCALE_SUFFIX = "_scale"
QUANTIZED_KINDS = ("column", "kv_column", "row")
_FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_CAST_CODE = {"fp32": "F32", "fp16": "F16", "bf16": "BF16", "int8": "F16", "fp8": "F16"}
_QUANT_CODE = {"int8": "I8", "fp8": "F8_E4M3"}
_QUANT_MAX = {"int8": 127.0, "fp8": 448.0}
_ROW_CHUNK = 4096  # rows per step when computing scales: bounds the float32 temporaries


@dataclass(frozen=True)
class _TensorPlan:
    name: str
    source: TensorEntry
    file: Path
    splits: tuple[Split, ...]  # one per rank
    out_code: str  # safetensors dtype written
    quantize: bool


def partition_checkpoint(info: CheckpointInfo, *, family: str, dtype: str, tp: int, head_dim: int, kv_heads: int,
                         out_dir: Path, progress: bool | Callable[[str], None] | None = None) -> list[Path]:
    """Write each rank's shard under `out_dir` and return their paths (rank order).

    `progress`: True/False forces the tqdm bar; None (or a message callback) shows it when stderr is a TTY.
    """
    if tp > 1 and not has_layout(family):
        raise InternalError(f"TP {tp} for {family}, which has no tensor-parallel layout; the planner plans it at TP 1")
    paths = [Path(out_dir) / shard_path(tp, rank) for rank in range(tp)]
    _write_rank_files(info, sorted(info.tensors), paths, family=family, dtype=dtype, tp=tp, head_dim=head_dim,
                      kv_heads=kv_heads, metadata={}, progress=progress)
    return paths


def _write_rank_files(info: CheckpointInfo, names: list[str], paths: list[Path], *, family: str, dtype: str, tp: int,
                      head_dim: int, kv_heads: int, metadata: dict[str, str],
                      progress: bool | Callable[[str], None] | None) -> None:
    """Write tensors `names` of `info`, split for TP `tp`, into `paths` (one file per rank)."""
    if dtype not in _CAST_CODE:
        raise InternalError(f"partition: unknown dtype {dtype!r}")
    if tp < 1 or len(paths) != tp:
        raise InternalError(f"partition: tensor-parallel degree {tp} with {len(paths)} output files")
    plans = [_plan_tensor(info, family, name, tp, head_dim, kv_heads, dtype) for name in names]
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "lmc.family": family, "lmc.tp": str(tp), "lmc.dtype": dtype, **metadata}
    if dtype in _QUANT_CODE:
        metadata.update({"lmc.quantization": "per-row-symmetric", "lmc.scale_suffix": SCALE_SUFFIX})
    total = sum(plan.source.nbytes for plan in plans)
    with ExitStack() as stack:
        stack.enter_context(_one_thread())
        writers = [stack.enter_context(StreamingWriter(path, _entries(plans, rank), dict(metadata, **{"lmc.rank": str(rank)})))
                   for rank, path in enumerate(paths)]
        bar = stack.enter_context(_progress_bar(total, _show_progress(progress)))
        for plan in plans:
            _write_tensor(plan, writers, dtype)
            bar.update(plan.source.nbytes)


def _plan_tensor(info: CheckpointInfo, family: str, name: str, tp: int, head_dim: int, kv_heads: int,
                 dtype: str) -> _TensorPlan:
    tensor = info.tensors[name]
    entry = TensorEntry(tensor.dtype, tuple(tensor.shape), tensor.offsets[0], tensor.offsets[1])
    try:
        splits = tuple(rank_split(family, name, entry.shape, rank, tp, head_dim, kv_heads) for rank in range(tp))
    except ValueError as exc:
        raise CheckpointError(f"{tensor.file}: tensor {name!r} {list(entry.shape)} cannot be split for tensor "
                              f"parallel degree {tp}: {exc}") from None
    is_float = entry.dtype in _FLOAT_CODES
    quantize = (dtype in _QUANT_CODE and is_float and len(entry.shape) == 2 and name.endswith("weight")
                and kind_of(family, name) in QUANTIZED_KINDS)
    out_code = _QUANT_CODE[dtype] if quantize else (_CAST_CODE[dtype] if is_float else entry.dtype)
    return _TensorPlan(name, entry, tensor.file, splits, out_code, quantize)


def _entries(plans: list[_TensorPlan], rank: int) -> list[tuple[str, str, tuple[int, ...]]]:
    entries = []
    for plan in plans:
        split = plan.splits[rank]
        shape = local_shape(plan.source.shape, split)
        entries.append((plan.name, plan.out_code, shape))
        if plan.quantize:
            entries.append((plan.name + SCALE_SUFFIX, "F32", (shape[0],)))
    return entries


def _write_tensor(plan: _TensorPlan, writers: list[StreamingWriter], dtype: str) -> None:
    import torch

    from lmc.emitters.safetensors_stream import torch_dtype

    with mapped_tensor(plan.file, plan.source) as source:
        scale = _row_scales(source, _QUANT_MAX[dtype]) if plan.quantize else None
        out_dtype = torch_dtype(plan.out_code)
        for writer, split in zip(writers, plan.splits):
            part = source if split.dim is None else torch.narrow(source, split.dim, split.start, split.stop - split.start)
            if scale is None:
                # .to() copies unless the dtype is unchanged; either way nothing else keeps a view of the map.
                cast = part.to(out_dtype).contiguous()
                if out_dtype == torch.float16 and cast.dtype != part.dtype and torch.isinf(cast).any() \
                        and not torch.isinf(part).any():
                    raise CheckpointError(f"{plan.file}: tensor {plan.name!r} has values beyond float16's range "
                                          f"(|x| > 65504): serve it in bf16 or fp32 instead of {dtype}")
                writer.write(plan.name, cast)
                del cast
            else:
                part_scale = scale[split.start:split.stop] if split.dim == 0 else scale
                writer.write(plan.name, _quantize(part, part_scale, dtype))
                writer.write(plan.name + SCALE_SUFFIX, part_scale.contiguous())
                del part_scale
            del part
        del source


def _row_scales(weight: "torch.Tensor", qmax: float) -> "torch.Tensor":
    import torch

    amax = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], _ROW_CHUNK):
        rows = weight[start:start + _ROW_CHUNK].float()
        amax[start:start + rows.shape[0]] = rows.abs().amax(dim=1)
    scale = amax / qmax
    scale[~(scale > 0)] = 1.0  # all-zero rows, and rows so tiny that amax / qmax underflows to 0
    return scale


def _quantize(part: "torch.Tensor", scale: "torch.Tensor", dtype: str) -> "torch.Tensor":
    import torch

    out = torch.empty(part.shape, dtype=torch.int8 if dtype == "int8" else torch.float8_e4m3fn)
    for start in range(0, part.shape[0], _ROW_CHUNK):
        rows = part[start:start + _ROW_CHUNK].float() / scale[start:start + _ROW_CHUNK, None]
        if dtype == "int8":
            out[start:start + rows.shape[0]] = rows.round_().clamp_(-127, 127).to(torch.int8)
        else:
            out[start:start + rows.shape[0]] = rows.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return out


@contextmanager
def _one_thread():
    """Casting and slicing are memory-bound: more intra-op threads gain nothing and, on a busy
    build host, spin-wait for cores (measured 4x slower with 2 threads than 1 on a loaded 2-core host)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _show_progress(progress: Any) -> bool:
    if isinstance(progress, bool):
        return progress
    return sys.stderr.isatty()


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="partitioning", file=sys.stderr,
                disable=not enabled, leave=False)


def gather_shards(paths: list[Path], family: str, head_dim: int, kv_heads: int) -> dict[str, "torch.Tensor"]:
    """Reassemble full tensors from rank files `paths` (rank order): the inverse of partition_checkpoint.

    Replicated kv heads (TP > kv heads) are de-duplicated; quantized weights come back dequantized
    (float32, Q · scale). For tests and debugging: loads every file whole.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    tp = len(paths)
    ranks = [load_file(str(path)) for path in paths]
    with safe_open(str(paths[0]), framework="pt") as handle:
        metadata = handle.metadata() or {}
    suffix = metadata.get("lmc.scale_suffix")
    full: dict[str, torch.Tensor] = {}
    for name in sorted(ranks[0]):
        if suffix and name.endswith(suffix) and name[: -len(suffix)] in ranks[0]:
            continue
        parts = [rank[name] for rank in ranks]
        if suffix and name + suffix in ranks[0]:
            parts = [part.float() * rank[name + suffix][:, None] for part, rank in zip(parts, ranks)]
        full[name] = _join(family, name, parts, tp, kv_heads)
    return full


def _join(family: str, name: str, parts: list["torch.Tensor"], tp: int, kv_heads: int) -> "torch.Tensor":
    import torch

    kind = kind_of(family, name)
    if tp == 1 or kind == "replicate" or (kind == "row" and parts[0].dim() < 2):
        return parts[0]
    if kind == "vocab" and parts[0].shape[0] % tp and all(torch.equal(parts[0], part) for part in parts[1:]):
        # Replicated (TP does not divide the vocabulary). Rows that divide by TP were split: a
        # replicated full tensor with such rows would itself have divided.
        return parts[0]
    if kind == "kv_column" and kv_heads % tp:
        per_head = tp // kv_heads
        return torch.cat(parts[::per_head], dim=0)
    dim = 1 if kind in ("row", "heads_dim1") else 0
    return torch.cat(parts, dim=dim)
