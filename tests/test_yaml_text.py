"""The YAML writer: what it writes reads back as the same data, strings never change type."""

from __future__ import annotations

import yaml

from lmc.emitters.yaml_text import dump, dump_all


def test_round_trip_keeps_types_and_order():
    data = {
        "on": "true", "mode": "0755", "n": 3, "x": 1.5, "flag": False, "none": None, "empty": {}, "list": [],
        "nested": {"a: b": "c # not a comment", "list": [{"name": "x", "args": ["--a", "1e3"]}, ["y", 2]]},
        "unicode": "µs – ok", "quote": 'say "hi"\n',
    }
    text = dump(data)
    assert yaml.safe_load(text) == data
    assert list(yaml.safe_load(text)) == list(data)
    assert text.splitlines()[0] == '"on": "true"'  # a YAML 1.1 boolean word is quoted as a key too


def test_documents_are_separated():
    text = dump_all([{"kind": "A"}, {"kind": "B"}])
    assert [d["kind"] for d in yaml.safe_load_all(text)] == ["A", "B"]
