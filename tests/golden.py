"""Golden files with syrupy: one snapshot per file, at golden/<spec>/<name>.

`pytest --snapshot-update` is the only way these files change; the diff is what reviewers read.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"


@cache
def golden_file(spec: str, filename: str) -> type[SingleFileSnapshotExtension]:
    """A syrupy extension that stores one text snapshot at golden/<spec>/<filename>."""
    stem, _, extension = filename.rpartition(".")

    class GoldenFile(SingleFileSnapshotExtension):
        _write_mode = WriteMode.TEXT
        file_extension = extension

        @classmethod
        def dirname(cls, *, test_location) -> str:
            return str(GOLDEN_DIR / spec)

        @classmethod
        def get_snapshot_name(cls, *, test_location, index=0) -> str:
            return stem

    GoldenFile.__name__ = f"Golden[{spec}/{filename}]"
    return GoldenFile
