"""A small, strict safetensors header parser with no dependencies, for the runtime (which must not
import lmc.emitters) to map shard files without copying them.

Format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON mapping tensor names to
{"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the end of the header), an
optional "__metadata__" object, then the data.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

# Safetensors dtype codes: (element size in bytes, torch dtype attribute name).
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2"),
    "I16": (2, "int16"), "U16": (2, "uint16"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
    "I32": (4, "int32"), "U32": (4, "uint32"), "F32": (4, "float32"),
    "I64": (8, "int64"), "U64": (8, "uint64"), "F64": (8, "float64"),
}
# The format's own reader refuses larger headers; a bigger length means a corrupt or foreign file.
MAX_HEADER_BYTES = 100 * 1024 * 1024


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


def header_length(prefix: bytes, file_size: int) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file size."""
    if len(prefix) < 8:
        raise HeaderError(f"{file_size} bytes, too short for a header")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > min(file_size - 8, MAX_HEADER_BYTES):
        raise HeaderError(f"header of {length} bytes does not fit in the {file_size}-byte file")
    return length


def parse_header(raw: bytes, file_size: int) -> dict[str, Entry]:
    """The tensors described by header JSON `raw` (the N bytes after the length), in file order,
    with offsets made absolute. Checks dtypes, shapes, that each span equals dtype size x elements
    and that it lies inside the file."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    data_start = 8 + len(raw)
    entries = {}
    for name, value in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(name, value, data_start, file_size)
    return dict(sorted(entries.items(), key=lambda item: item[1].begin))


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
    expected = DTYPES[dtype][0] * math.prod(shape)
    if end - begin != expected:
        raise HeaderError(f"tensor {name!r} spans {end - begin} bytes; {dtype} x {shape} needs {expected}")
    if end > file_size:
        raise HeaderError(f"tensor {name!r} ends at byte {end}, past the end of the {file_size}-byte file "
                          "(truncated?)")
    return Entry(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
