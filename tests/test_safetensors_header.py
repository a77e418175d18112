"""The shared safetensors header parser: checks not already exercised through its callers' tests
(test_checkpoint_facts, test_checkpoint_validation, test_cold_start_paths)."""

import json
import struct
import sys

import pytest

from lmc.safetensors_header import MAX_HEADER_BYTES, HeaderError, header_length, parse_header, read_header


def _raw(header: dict) -> bytes:
    return json.dumps(header).encode()


def _write(path, header: dict, data: bytes):
    raw = _raw(header)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_header_over_the_format_limit_is_refused_even_when_the_file_is_big_enough():
    prefix = struct.pack("<Q", MAX_HEADER_BYTES + 1)
    with pytest.raises(HeaderError, match=rf"header of {MAX_HEADER_BYTES + 1} bytes is over the format's limit"):
        header_length(prefix, MAX_HEADER_BYTES + 100)
    assert header_length(struct.pack("<Q", MAX_HEADER_BYTES), MAX_HEADER_BYTES + 8) == MAX_HEADER_BYTES


@pytest.mark.parametrize("metadata", [{"format": 1}, ["pt"], "pt"])
def test_metadata_must_map_strings_to_strings(metadata):
    with pytest.raises(HeaderError, match="__metadata__ must map strings to strings"):
        parse_header(_raw({"__metadata__": metadata}), 100)


def test_an_entry_that_is_not_an_object_is_named():
    with pytest.raises(HeaderError, match=r"entry 'w' is not an object"):
        parse_header(_raw({"w": [1, 2]}), 100)


@pytest.mark.parametrize("shape", [[2.0], [True], "2", None])
def test_shapes_must_be_lists_of_integers(shape):
    with pytest.raises(HeaderError, match=r"tensor 'w' has an invalid shape"):
        parse_header(_raw({"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 2]}}), 100)


@pytest.mark.parametrize("offsets", [[0], [0, 2, 4], [-1, 1], [0, "2"], None])
def test_data_offsets_must_be_two_ordered_counts(offsets):
    with pytest.raises(HeaderError, match=r"tensor 'w' has invalid data_offsets"):
        parse_header(_raw({"w": {"dtype": "U8", "shape": [2], "data_offsets": offsets}}), 100)


def test_deeply_nested_json_is_a_header_error_not_a_crash():
    depth = sys.getrecursionlimit() * 2
    with pytest.raises(HeaderError, match="header is not valid JSON"):
        parse_header(b"[" * depth + b"]" * depth, 10**6)


def test_tiling_is_checked_only_when_asked(tmp_path):
    gap = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
           "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}
    path = _write(tmp_path / "gap.safetensors", gap, bytes(6))
    header = read_header(path)  # the planner and the runtime accept a gap: every tensor is still readable
    assert [(name, entry.nbytes) for name, entry in header.tensors.items()] == [("a", 2), ("b", 2)]
    assert header.tensors["b"].begin == header.data_start + 4 and header.path == path
    with pytest.raises(HeaderError, match=r"^2 unused bytes before tensor 'b'$"):
        read_header(path, require_tiling=True)


def test_overlapping_tensors_are_refused_when_tiling_is_required(tmp_path):
    overlap = {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
               "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}
    path = _write(tmp_path / "overlap.safetensors", overlap, bytes(4))
    with pytest.raises(HeaderError, match=r"^tensor 'b' overlaps the tensor before it$"):
        read_header(path, require_tiling=True)


def test_trailing_bytes_are_refused_when_tiling_is_required(tmp_path):
    path = _write(tmp_path / "tail.safetensors", {"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, bytes(7))
    assert list(read_header(path).tensors) == ["a"]
    with pytest.raises(HeaderError, match=r"^3 bytes after the last tensor$"):
        read_header(path, require_tiling=True)


def test_a_well_formed_file_tiles(tmp_path):
    header = {"__metadata__": {"format": "pt"},
              "z": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [4, 4]},
              "a": {"dtype": "I8", "shape": [3], "data_offsets": [4, 7]}}
    path = _write(tmp_path / "ok.safetensors", header, bytes(7))
    parsed = read_header(path, require_tiling=True)
    assert parsed.metadata == {"format": "pt"}
    assert list(parsed.tensors) == ["z", "e", "a"]  # file order, not name order
    assert parsed.tensors["e"].shape == (0, 3) and parsed.tensors["a"].nbytes == 3
