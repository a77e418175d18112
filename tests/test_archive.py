"""The artifact archive: byte-identical, sorted, host-free, atomic; the extractor refuses unsafe members."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest

from lmc.emitters import archive
from lmc.emitters.archive import archive_listing, write_artifact
from lmc.runtime.startup import extract_archive
from lmc.errors import ArtifactError


def _tree(root: Path) -> Path:
    (root / "shards" / "tp2").mkdir(parents=True)
    (root / "lmc.json").write_text('{"format_version": 1}\n')
    (root / "serving.properties").write_text("engine=Python\n")
    (root / "shards" / "tp2" / "rank1.safetensors").write_bytes(os.urandom(0) + bytes(range(256)) * 40)
    (root / "shards" / "tp2" / "rank0.safetensors").write_bytes(b"\x01" * 5000)
    (root / "a-file").write_text("sorts before shards/\n")
    return root


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_tree_same_bytes_whatever_mtime_mode_owner(tmp_path):
    tree = _tree(tmp_path / "tree")
    first = write_artifact(tree, tmp_path / "a.tar.gz", fmt="tar.gz")
    for path in tree.rglob("*"):
        os.utime(path, (1_700_000_000, 1_700_000_000))
    os.chmod(tree / "serving.properties", 0o600)
    os.chmod(tree / "lmc.json", 0o755)
    os.chmod(tree / "shards", 0o700)
    if os.geteuid() == 0:  # another owner, where the test may change it
        os.chown(tree / "serving.properties", 12345, 23456)
        assert (tree / "serving.properties").stat().st_uid == 12345
    second = write_artifact(tree, tmp_path / "b.tar.gz", fmt="tar.gz")
    assert _sha(first) == _sha(second)


def test_members_sorted_relative_and_host_free(tmp_path):
    out = write_artifact(_tree(tmp_path / "tree"), tmp_path / "model.tar.gz", fmt="tar.gz")
    raw = out.read_bytes()
    assert raw[4:8] == b"\0\0\0\0"  # gzip mtime 0
    assert raw[3] & 0x08 == 0  # no FNAME field: the temp file's name is not recorded
    with tarfile.open(out, "r:gz") as tar:
        members = tar.getmembers()
        assert all(m.pax_headers == {} for m in members)  # nothing about the host or the build time
    names = [m.name for m in members]
    assert names == sorted(names)
    assert names == ["a-file", "lmc.json", "serving.properties", "shards", "shards/tp2",
                     "shards/tp2/rank0.safetensors", "shards/tp2/rank1.safetensors"]
    for member in members:
        assert not member.name.startswith("/") and ".." not in member.name.split("/")
        assert (member.mtime, member.uid, member.gid, member.uname, member.gname) == (0, 0, 0, "", "")
        assert member.mode == (0o755 if member.isdir() else 0o644)
    assert oct(out.stat().st_mode & 0o777) == oct(0o644)


def test_listing_matches_files(tmp_path):
    tree = _tree(tmp_path / "tree")
    listing = archive_listing(write_artifact(tree, tmp_path / "m.tar.gz", fmt="tar.gz"))
    assert [path for path, _, _ in listing] == ["a-file", "lmc.json", "serving.properties",
                                                "shards/tp2/rank0.safetensors", "shards/tp2/rank1.safetensors"]
    for path, size, digest in listing:
        assert size == (tree / path).stat().st_size and digest == _sha(tree / path)


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    tree = _tree(tmp_path / "tree")
    out = tmp_path / "out" / "model.tar.gz"
    out.parent.mkdir()
    calls = []
    real = archive._add_member

    def flaky(tar, path, rel, is_dir):
        calls.append(rel)
        if len(calls) == 4:
            raise RuntimeError("disk on fire")
        real(tar, path, rel, is_dir)

    monkeypatch.setattr(archive, "_add_member", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_artifact(tree, out, fmt="tar.gz")
    assert list(out.parent.iterdir()) == []


def test_failure_keeps_previous_archive(tmp_path, monkeypatch):
    tree = _tree(tmp_path / "tree")
    out = write_artifact(tree, tmp_path / "model.tar.gz", fmt="tar.gz")
    before = _sha(out)
    monkeypatch.setattr(archive, "_add_member", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(ArtifactError) as error:
        write_artifact(tree, out, fmt="tar.gz")
    assert str(error.value) == f"{out}: cannot write the artifact: No space left on device"
    assert _sha(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.tar.gz", "tree"]


def test_unwritable_output_path(tmp_path):
    tree = _tree(tmp_path / "tree")
    missing = tmp_path / "no" / "such" / "model.tar.gz"
    with pytest.raises(ArtifactError) as error:
        write_artifact(tree, missing, fmt="tar.gz")
    assert str(error.value) == f"{missing}: cannot write the artifact: No such file or directory"
    with pytest.raises(ArtifactError, match="is a directory; give a file name"):
        write_artifact(tree, tmp_path, fmt="tar.gz")


def test_a_directory_the_system_refuses_is_one_line_even_for_root(tmp_path):
    """Where the OS refuses the write to anyone, root included (CI runs as root, which a chmod 555
    directory does not stop): sysfs takes no new files (EACCES; EROFS where it is mounted read-only), and a
    path under a regular file is no directory. One line each with the system's reason; nothing written."""
    tree = _tree(tmp_path / "tree")
    sysfs = Path("/sys/kernel")
    if not sysfs.is_dir():
        pytest.skip("no sysfs mounted at /sys")
    out = sysfs / "model.tar.gz"
    with pytest.raises(ArtifactError) as error:
        write_artifact(tree, out, fmt="tar.gz")
    assert str(error.value) in (f"{out}: cannot write the artifact: Permission denied",
                                f"{out}: cannot write the artifact: Read-only file system")
    assert not out.exists()
    (tmp_path / "a-file").write_text("not a directory")
    out = tmp_path / "a-file" / "model.tar.gz"
    with pytest.raises(ArtifactError) as error:
        write_artifact(tree, out, fmt="tar.gz")
    assert str(error.value) == f"{out}: cannot write the artifact: Not a directory"
    assert (tmp_path / "a-file").read_text() == "not a directory"


def test_dir_format_same_files_and_overwrite_rules(tmp_path):
    tree = _tree(tmp_path / "tree")
    tar_listing = archive_listing(write_artifact(tree, tmp_path / "m.tar.gz", fmt="tar.gz"))
    out = write_artifact(tree, tmp_path / "d", fmt="dir")
    assert archive_listing(out) == tar_listing
    assert (out / "lmc.json").stat().st_mode & 0o777 == 0o644
    # A previous artifact (it has lmc.json) is replaced; a foreign non-empty directory is not.
    (out / "stale").write_text("old")
    write_artifact(tree, out, fmt="dir")
    assert not (out / "stale").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="is not empty and is not an lmc artifact; refusing to overwrite it"):
        write_artifact(tree, foreign, fmt="dir")
    assert (foreign / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "foreign", "m.tar.gz", "tree"]


def test_dir_move_empties_the_tree(tmp_path):
    tree = _tree(tmp_path / "tree")
    expected = archive_listing(write_artifact(tree, tmp_path / "m.tar.gz", fmt="tar.gz"))
    out = write_artifact(tree, tmp_path / "d", fmt="dir", move=True)
    assert archive_listing(out) == expected
    assert not (tree / "lmc.json").exists()


def test_the_runtime_extracts_what_the_build_writes(tmp_path):
    tree = _tree(tmp_path / "tree")
    out = write_artifact(tree, tmp_path / "m.tar.gz", fmt="tar.gz")
    dest = extract_archive(out, tmp_path / "x")
    assert archive_listing(dest) == archive_listing(out)


def test_tree_with_symlink_is_refused(tmp_path):
    tree = _tree(tmp_path / "tree")
    (tree / "link").symlink_to(tree / "lmc.json")
    with pytest.raises(ArtifactError, match="link: not a regular file or directory"):
        write_artifact(tree, tmp_path / "m.tar.gz", fmt="tar.gz")
