"""The deterministic, atomic artifact: `model.tar.gz` (or the same tree as a directory).

Deterministic: the same tree gives the same bytes whatever the build host. Members are sorted by
path; every member has mtime 0, uid/gid 0, empty user and group names, mode 0644 (files) or 0755
(directories); the tar format is PAX throughout; the gzip header has mtime 0 and no file name, and
the compression level is fixed (1: the shards, most of the bytes, are near-incompressible weights,
so a higher level costs minutes on big models and saves little).

Atomic: the archive is written to a temporary file next to `out` (same filesystem) and renamed
over `out` only when complete; on any failure the temporary file is removed and `out` is untouched.

`--format dir` (fmt="dir") writes the same tree into a temporary directory next to `out` and
renames it into place. An existing `out` is replaced only when it is empty or is a previous lmc
artifact (it holds lmc.json); any other existing directory is refused rather than overwritten.

Reading an archive back is the runtime's job (`lmc.runtime.startup.extract_archive`).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import stat
import tarfile
import tempfile
from pathlib import Path
from typing import Literal

from lmc.errors import ArtifactError
from lmc.manifest import MANIFEST_NAME

COMPRESS_LEVEL = 1
FILE_MODE = 0o644
DIR_MODE = 0o755
_CHUNK = 8 * 1024 * 1024


def write_artifact(tree: Path, out: Path, *, fmt: Literal["tar.gz", "dir"], move: bool = False) -> Path:
    """Write the files under `tree` to `out` as a deterministic .tar.gz or a directory; returns `out`.

    `move=True` (dir format only) renames the tree's files into place instead of copying them: for a
    staging tree that is deleted afterwards, it saves copying the weights.
    """
    tree, out = Path(tree), Path(out)
    entries = _tree_entries(tree)
    if fmt == "tar.gz":
        return _write_tar_gz(tree, entries, out)
    if fmt == "dir":
        return _write_dir(tree, entries, out, move)
    raise ArtifactError(f"{out}: unknown artifact format {fmt!r}; expected tar.gz or dir")


def _tree_entries(tree: Path) -> list[tuple[str, bool]]:
    """(relative posix path, is_dir) of everything under `tree`, sorted; only files and directories."""
    if not tree.is_dir():
        raise ArtifactError(f"{tree}: the tree to archive is not a directory")
    entries = []
    for root, dirs, files in os.walk(tree):
        for name in dirs + files:
            path = Path(root) / name
            mode = path.lstat().st_mode
            rel = path.relative_to(tree).as_posix()
            if stat.S_ISDIR(mode):
                entries.append((rel, True))
            elif stat.S_ISREG(mode):
                entries.append((rel, False))
            else:
                raise ArtifactError(f"{path}: not a regular file or directory (links and devices are not packed)")
    return sorted(entries)


def _temp_error(out: Path, exc: OSError) -> ArtifactError:
    return ArtifactError(f"{out}: cannot write the artifact: {exc.strerror or exc}")


def _write_tar_gz(tree: Path, entries: list[tuple[str, bool]], out: Path) -> Path:
    if out.is_dir():
        raise ArtifactError(f"{out}: is a directory; give a file name for the .tar.gz (or use --format dir)")
    parent = out.parent if str(out.parent) else Path(".")
    try:
        fd, temp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=parent)
    except OSError as exc:
        raise _temp_error(out, exc) from None
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=COMPRESS_LEVEL, mtime=0) as gz:
                with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                    for rel, is_dir in entries:
                        _add_member(tar, tree / rel, rel, is_dir)
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(temp, FILE_MODE)
        os.replace(temp, out)
    except BaseException as exc:
        temp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _temp_error(out, exc) from None
        raise
    return out


def _add_member(tar: tarfile.TarFile, path: Path, rel: str, is_dir: bool) -> None:
    info = tarfile.TarInfo(rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if is_dir:
        info.type, info.mode, info.size = tarfile.DIRTYPE, DIR_MODE, 0
        tar.addfile(info)
        return
    info.type, info.mode = tarfile.REGTYPE, FILE_MODE
    with open(path, "rb") as handle:
        info.size = os.fstat(handle.fileno()).st_size
        tar.addfile(info, handle)


def _write_dir(tree: Path, entries: list[tuple[str, bool]], out: Path, move: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out}: exists and is not a directory; --format dir writes a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise ArtifactError(f"{out}: exists, is not empty and is not an lmc artifact; refusing to overwrite it")
    parent = out.parent if str(out.parent) else Path(".")
    try:
        temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise _temp_error(out, exc) from None
    old = None
    try:
        for rel, is_dir in entries:
            target = temp / rel
            if is_dir:
                target.mkdir()
            else:
                (os.replace if move else shutil.copyfile)(tree / rel, target)
                os.chmod(target, FILE_MODE)
        for rel, is_dir in entries:
            if is_dir:
                os.chmod(temp / rel, DIR_MODE)
        os.chmod(temp, DIR_MODE)
        if out.is_dir():
            # Set the previous artifact aside, put the new one in place, then delete the old one.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=parent))
            os.rmdir(old)
            os.rename(out, old)
        os.rename(temp, out)
    except BaseException as exc:
        shutil.rmtree(temp, ignore_errors=True)
        if old is not None and old.exists() and not out.exists():
            os.rename(old, out)
        if isinstance(exc, OSError):
            raise _temp_error(out, exc) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def archive_listing(out: Path) -> list[tuple[str, int, str]]:
    """(path, size, sha256) of every file in the artifact at `out` (.tar.gz or directory), in archive order."""
    out = Path(out)
    if out.is_dir():
        return [(rel, (out / rel).stat().st_size, _sha256_stream(open(out / rel, "rb")))
                for rel, is_dir in _tree_entries(out) if not is_dir]
    listing = []
    with _open_tar(out) as tar:
        for member in tar:
            if member.isfile():
                listing.append((member.name, member.size, _sha256_stream(tar.extractfile(member))))
    return listing


def _sha256_stream(handle) -> str:
    digest = hashlib.sha256()
    with handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _open_tar(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, mode="r:gz")
    except FileNotFoundError:
        raise ArtifactError(f"{archive}: no such artifact") from None
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise ArtifactError(f"{archive}: not a readable .tar.gz ({' '.join(str(exc).split())})") from None
