"""A small, deterministic YAML writer for Kubernetes manifests (block style, keys in the order given).

Strings are always double-quoted with JSON escapes (valid YAML), so no value changes type on the
way ("true", "0755", "1e3" stay strings); keys are plain where they are simple names.
"""

from __future__ import annotations

import json
import re

_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def _scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"no YAML for {value}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"no YAML for {type(value).__name__}")


def _key(key: str) -> str:
    if _PLAIN_KEY.match(key) and key.lower() not in _YAML_WORDS:
        return key
    return json.dumps(key, ensure_ascii=False)


def _lines(value, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return [pad + "{}"]
        out = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{_key(key)}:")
                out += _lines(item, indent + 2 if isinstance(item, dict) else indent)
            else:
                out.append(f"{pad}{_key(key)}: {_inline(item)}")
        return out
    if isinstance(value, list):
        if not value:
            return [pad + "[]"]
        out = []
        for item in value:
            if isinstance(item, (dict, list)) and item:
                inner = _lines(item, indent + 2)
                out.append(f"{pad}- {inner[0].lstrip()}")
                out += inner[1:]
            else:
                out.append(f"{pad}- {_inline(item)}")
        return out
    return [pad + _scalar(value)]


def _inline(value) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def dump(document: dict) -> str:
    """One YAML document (no leading `---`), ending in a newline."""
    return "\n".join(_lines(document, 0)) + "\n"


def dump_all(documents: list[dict]) -> str:
    """Several documents separated by `---`."""
    return "---\n".join(dump(d) for d in documents)
