"""Environment variables set for the length of a `with` block."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set `values` in os.environ inside the block; afterwards each key is back to what it was (unset if
    it was unset)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
