"""Safetensors without loading whole files: parse and check a header, read one tensor (or a slice
along one dimension), and write a file tensor by tensor with memory bounded by one tensor.

Whole files are never mapped: pages of a mapped file count in the process's resident memory, so
mapping a 2 GB checkpoint and reading it through would make the partitioner's peak RSS grow with
the model instead of with its largest tensor. `read_tensor` uses plain reads; `mapped_tensor` maps
one tensor's bytes for the time it takes to process them.

The writer lays tensors out the way `safetensors.torch.save_file` does (largest element size first,
then by name, so every tensor is naturally aligned behind a header padded with spaces to 8 bytes)
and writes the header first: callers then write tensors in any order, each going to its own offset.
Given the same entries and metadata the bytes are the same.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping

from lmc.errors import CheckpointError, InternalError

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Safetensors dtype codes and their element sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
}
# A header larger than this is not a safetensors header (the format's own reader caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype code, shape, and absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A parsed, checked safetensors header."""

    path: Path
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]


def torch_dtype(code: str) -> "torch.dtype":
    import torch

    return getattr(torch, _TORCH_NAMES[code])


def dtype_code(dtype: "torch.dtype") -> str:
    name = str(dtype).removeprefix("torch.")
    for code, torch_name in _TORCH_NAMES.items():
        if torch_name == name:
            return code
    raise InternalError(f"no safetensors dtype for {dtype}")


def read_header(path: Path) -> Header:
    """Parse `path`'s header and check it against the file: every error names the file.

    Checks: an 8-byte little-endian length that fits in the file; UTF-8 JSON object; known dtypes;
    integer shapes; data_offsets whose span matches dtype x shape, that lie inside the file, and
    that tile the data area without gaps or overlaps (what the safetensors format requires).
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file: {size} bytes, too short for a header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: truncated or corrupt safetensors: header of {header_len} bytes "
                                      f"does not fit in the {size}-byte file")
            raw = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must map strings to strings")
    tensors = {name: _entry(path, name, value, data_start) for name, value in header.items()}
    _check_tiling(path, tensors, data_start, size)
    return Header(path=path, data_start=data_start, metadata=dict(metadata), tensors=tensors)


def _entry(path: Path, name: str, value: object, data_start: int) -> TensorEntry:
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: entry {name!r} is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    count = 1
    for dim in shape:
        count *= dim
    if offsets[1] - offsets[0] != count * DTYPE_SIZES[dtype]:
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
                              f"but {dtype} {shape} needs {count * DTYPE_SIZES[dtype]}")
    return TensorEntry(dtype=dtype, shape=tuple(shape), begin=data_start + offsets[0], end=data_start + offsets[1])


def _check_tiling(path: Path, tensors: dict[str, TensorEntry], data_start: int, size: int) -> None:
    position = data_start
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.end > size:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors: tensor {name!r} ends at byte {entry.end}, "
                                  f"past the end of the {size}-byte file")
        if entry.begin < position:
            raise CheckpointError(f"{path}: corrupt safetensors: tensor {name!r} overlaps the tensor before it")
        if entry.begin > position:
            raise CheckpointError(f"{path}: corrupt safetensors: {entry.begin - position} unused bytes before tensor {name!r}")
        position = entry.end
    if position != size:
        raise CheckpointError(f"{path}: corrupt safetensors: {size - position} bytes after the last tensor")


def read_tensor(path: Path, entry: TensorEntry, *, dim: int | None = None, start: int = 0,
                stop: int | None = None) -> "torch.Tensor":
    """The tensor `entry` of `path`, or its [start:stop) slice along `dim`, as a new CPU tensor.

    A slice along dim 0 reads only its own bytes; along another dim the tensor is read whole (it
    is one tensor, the bound the partitioner promises) and the slice copied out.
    """
    import torch

    if dim is None:
        return _read_bytes(path, entry.begin, entry.nbytes, entry.dtype).reshape(entry.shape)
    stop = entry.shape[dim] if stop is None else stop
    if not 0 <= start <= stop <= entry.shape[dim]:
        raise InternalError(f"slice {start}:{stop} of dim {dim} outside {entry.shape}")
    if dim == 0:
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        count = stop - start
        flat = _read_bytes(path, entry.begin + start * row_bytes, count * row_bytes, entry.dtype)
        return flat.reshape((count, *entry.shape[1:]))
    whole = read_tensor(path, entry)
    part = torch.narrow(whole, dim, start, stop - start).contiguous()
    del whole
    return part


@contextmanager
def mapped_tensor(path: Path, entry: TensorEntry) -> Iterator["torch.Tensor"]:
    """The tensor `entry` of `path` as a zero-copy view of a private map of its own bytes only.

    Only this tensor's pages are mapped, and only until the block ends, so resident memory stays
    bounded by one tensor while saving the copy a read makes. Callers must drop every view of the
    tensor before the block ends (the map cannot close while a view still points into it).
    """
    import torch

    start = entry.begin - entry.begin % mmap.ALLOCATIONGRANULARITY
    length = entry.end - start
    if entry.nbytes == 0:
        yield torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        return
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), length, offset=start, access=mmap.ACCESS_COPY)
    try:
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=entry.nbytes, offset=entry.begin - start)
        tensor = flat.view(torch_dtype(entry.dtype)).reshape(entry.shape)
        del flat
        yield tensor
        del tensor
    finally:
        try:
            mapping.close()
        except BufferError:  # a view escaped: the map closes when it is collected
            pass


def _read_bytes(path: Path, offset: int, nbytes: int, code: str) -> "torch.Tensor":
    import torch

    buffer = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    with open(path, "rb", buffering=0) as handle:
        handle.seek(offset)
        done = 0
        while done < nbytes:
            got = handle.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{path}: truncated: expected {nbytes} bytes at offset {offset}, got {done}")
            done += got
    return buffer.view(torch_dtype(code))


def layout(entries: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """(name, dtype code, shape, begin, end) relative to the data area, in file order.

    The order is safetensors' own: larger elements first, then by name.
    """
    rows = sorted(entries, key=lambda e: (-DTYPE_SIZES[e[1]], e[0]))
    names = [row[0] for row in rows]
    if len(set(names)) != len(names):
        raise InternalError("duplicate tensor names in a safetensors layout")
    out, position = [], 0
    for name, code, shape in rows:
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * DTYPE_SIZES[code]
        out.append((name, code, tuple(shape), position, position + nbytes))
        position += nbytes
    return out


def header_bytes(entries: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]) -> tuple[bytes, list]:
    """The 8-byte length plus the JSON header (sorted keys, padded with spaces to 8 bytes), and the layout."""
    rows = layout(entries)
    header: dict[str, object] = {name: {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
                                 for name, code, shape, begin, end in rows}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, rows


class StreamingWriter:
    """Write a safetensors file whose entries are known up front, one tensor at a time.

    `with StreamingWriter(path, entries, metadata) as writer: writer.write(name, tensor)` for every
    entry, in any order. Leaving the block without an exception checks that every entry was
    written; leaving it with one removes the partial file.
    """

    def __init__(self, path: Path, entries: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        prefix, rows = header_bytes(entries, metadata or {})
        self._data_start = len(prefix)
        self._rows = {name: (code, shape, begin, end) for name, code, shape, begin, end in rows}
        self._written: set[str] = set()
        self._size = self._data_start + (rows[-1][4] if rows else 0)
        self._handle = open(self.path, "wb")
        self._handle.write(prefix)

    def write(self, name: str, tensor: "torch.Tensor") -> None:
        if name not in self._rows:
            raise InternalError(f"{self.path}: tensor {name!r} was not declared")
        if name in self._written:
            raise InternalError(f"{self.path}: tensor {name!r} written twice")
        code, shape, begin, end = self._rows[name]
        if dtype_code(tensor.dtype) != code or tuple(tensor.shape) != shape:
            raise InternalError(f"{self.path}: tensor {name!r} is {dtype_code(tensor.dtype)} {tuple(tensor.shape)}, "
                                f"declared {code} {shape}")
        import torch

        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._handle.seek(self._data_start + begin)
        self._handle.write(memoryview(data))
        self._written.add(name)

    def close(self) -> None:
        missing = sorted(set(self._rows) - self._written)
        self._handle.close()
        if missing:
            raise InternalError(f"{self.path}: {len(missing)} declared tensors never written (first: {missing[0]})")
        if self.path.stat().st_size != self._size:
            raise InternalError(f"{self.path}: wrote {self.path.stat().st_size} bytes, expected {self._size}")

    def abort(self) -> None:
        self._handle.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
