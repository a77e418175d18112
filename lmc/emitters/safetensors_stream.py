"""Safetensors without loading whole files: check a header, read one tensor (or a slice
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
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping

from lmc.errors import CheckpointError, InternalError
from lmc.safetensors_header import DTYPES, Entry, Header, HeaderError
from lmc.safetensors_header import read_header as parse_file_header

if TYPE_CHECKING:  # pragma: no cover
    import torch

# The header parser and dtype table are lmc.safetensors_header's (shared with the planner and the
# runtime); partition.py knows the entry type by this name.
TensorEntry = Entry


def torch_dtype(code: str) -> "torch.dtype":
    import torch

    return getattr(torch, DTYPES[code].torch_name)


def dtype_code(dtype: "torch.dtype") -> str:
    name = str(dtype).removeprefix("torch.")
    for code, entry in DTYPES.items():
        if entry.torch_name == name:
            return code
    raise InternalError(f"no safetensors dtype for {dtype}")


def read_header(path: Path) -> Header:
    """Parse and check `path`'s header (see lmc.safetensors_header), tiling included: a checkpoint
    lmc builds from must be a well-formed safetensors file. Every error names the file."""
    try:
        return parse_file_header(path, require_tiling=True)
    except HeaderError as exc:
        raise CheckpointError(f"{path}: corrupt safetensors file: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None


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
    rows = sorted(entries, key=lambda e: (-DTYPES[e[1]].size, e[0]))
    names = [row[0] for row in rows]
    if len(set(names)) != len(names):
        raise InternalError("duplicate tensor names in a safetensors layout")
    out, position = [], 0
    for name, code, shape in rows:
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * DTYPES[code].size
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
