"""lmc's one safetensors header parser: pure Python, no dependencies, so the planner (which must not
import torch), the emitters and the runtime (which must not import lmc.emitters) all check a file
the same way.

Format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON mapping tensor names to
{"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the end of the header), an
optional "__metadata__" object of strings, then the data.

Errors are `HeaderError`s whose message says what is wrong without naming the file: each caller
prefixes the path and raises its own error type (CheckpointError for a checkpoint, ArtifactError for
a built shard), so the same defect reads the same wherever it is found.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


class DType(NamedTuple):
    size: int  # bytes per element
    torch_name: str  # the torch dtype attribute


# Safetensors dtype codes: the only table of them in lmc.
DTYPES: dict[str, DType] = {
    "BOOL": DType(1, "bool"), "U8": DType(1, "uint8"), "I8": DType(1, "int8"),
    "F8_E4M3": DType(1, "float8_e4m3fn"), "F8_E5M2": DType(1, "float8_e5m2"),
    "I16": DType(2, "int16"), "U16": DType(2, "uint16"), "F16": DType(2, "float16"), "BF16": DType(2, "bfloat16"),
    "I32": DType(4, "int32"), "U32": DType(4, "uint32"), "F32": DType(4, "float32"),
    "I64": DType(8, "int64"), "U64": DType(8, "uint64"), "F64": DType(8, "float64"),
}
# The format's own reader refuses larger headers; a bigger length means a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """The bytes are not a well-formed safetensors file; the message says what is wrong (no path:
    the caller names the file in its own error type)."""


@dataclass(frozen=True)
class Entry:
    """One tensor: its dtype code, shape and absolute byte range [begin, end) in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A parsed, checked header: where the data starts, the metadata, the tensors in file order."""

    path: Path
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, Entry]


def read_header(path: Path, *, require_tiling: bool = False) -> Header:
    """The checked header of the safetensors file `path`; tensor data is never read.

    Raises HeaderError for a malformed file (see parse_header; `require_tiling` adds the check that
    the tensors cover the data area exactly) and lets OSError through for the caller to word.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        raw = handle.read(header_length(handle.read(8), size))
    metadata, tensors = parse_header(raw, size, require_tiling=require_tiling)
    return Header(path=path, data_start=8 + len(raw), metadata=metadata, tensors=tensors)


def header_length(prefix: bytes, file_size: int) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file size."""
    if len(prefix) < 8:
        raise HeaderError(f"{file_size} bytes, too short for a header")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > file_size - 8:
        raise HeaderError(f"header of {length} bytes does not fit in the {file_size}-byte file (truncated?)")
    if length > MAX_HEADER_BYTES:
        raise HeaderError(f"header of {length} bytes is over the format's limit of {MAX_HEADER_BYTES}")
    return length


def parse_header(raw: bytes, file_size: int, *,
                 require_tiling: bool = False) -> tuple[dict[str, str], dict[str, Entry]]:
    """The metadata and the tensors (in file order, offsets made absolute) described by header JSON
    `raw`, the N bytes after the length, of a file of `file_size` bytes.

    Checks: a UTF-8 JSON object; __metadata__ mapping strings to strings; known dtypes; shapes of
    non-negative integers; data_offsets of two non-negative integers in order, spanning dtype size x
    elements, inside the file. With `require_tiling`, also that the tensors cover the data area
    without gaps, overlaps or trailing bytes, as the format requires (readers other than lmc's may
    rely on it, so checkpoints lmc builds from are held to it).
    """
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise HeaderError(f"header is not valid JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    data_start = 8 + len(raw)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise HeaderError("__metadata__ must map strings to strings")
    entries = [(name, _entry(name, value, data_start, file_size)) for name, value in header.items()]
    entries.sort(key=lambda item: (item[1].begin, item[1].end))
    if require_tiling:
        _check_tiling(entries, data_start, file_size)
    return dict(metadata), dict(entries)


def _entry(name: str, value: object, data_start: int, file_size: int) -> Entry:
    if not isinstance(value, dict):
        raise HeaderError(f"entry {name!r} is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPES:
        raise HeaderError(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise HeaderError(f"tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise HeaderError(f"tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    expected = DTYPES[dtype].size * math.prod(shape)
    if end - begin != expected:
        raise HeaderError(f"tensor {name!r} spans {end - begin} bytes; {dtype} x {shape} needs {expected}")
    if end > file_size:
        raise HeaderError(f"tensor {name!r} ends at byte {end}, past the end of the {file_size}-byte file "
                          "(truncated?)")
    return Entry(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_tiling(entries: list[tuple[str, Entry]], data_start: int, file_size: int) -> None:
    position = data_start
    for name, entry in entries:
        if entry.begin < position:
            raise HeaderError(f"tensor {name!r} overlaps the tensor before it")
        if entry.begin > position:
            raise HeaderError(f"{entry.begin - position} unused bytes before tensor {name!r}")
        position = entry.end
    if position != file_size:
        raise HeaderError(f"{file_size - position} bytes after the last tensor")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
