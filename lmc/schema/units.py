"""Sizes parsed on purpose: "24GiB" is 24·2^30 bytes, "24GB" is 24·10^9. Bytes are integers."""

from __future__ import annotations

import re

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes from an integer or a string such as "20GiB", "512MB", "1.5GiB". Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as \"20GiB\" or an integer number of bytes, got a boolean")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("must be a positive number of bytes")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as \"20GiB\" or an integer number of bytes, got {type(value).__name__}")
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a size; write e.g. \"20GiB\" (2^30 bytes) or \"20GB\" (10^9 bytes)")
    number, unit = match.groups()
    size = int(float(number) * _UNITS[unit.upper()])
    if size <= 0:
        raise ValueError("must be a positive size")
    return size


def format_bytes(size: int) -> str:
    """A human figure in binary units: 12.1 GiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
