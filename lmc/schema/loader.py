"""TOML in, `Spec` out. The source's only job is a dict; validation happens once, strictly.

Errors are one line: `specs/x.toml:7: target.instance = "ml.g5.13xlarge": unknown instance; ...`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lmc.errors import SpecError
from lmc.schema.spec import Spec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_TABLE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\" ]+?)\s*\]\s*(?:#.*)?$")
_ARRAY_TABLE = re.compile(r"^\s*\[\[\s*([A-Za-z0-9_\-\" ]+?)\s*\]\]\s*(?:#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+|\"[^\"]*\")\s*=")


@dataclass(frozen=True)
class SpecSource:
    """Where a spec came from, to point errors at the file and line."""

    path: Path
    text: str
    lines: dict[str, int] = field(default_factory=dict)

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def line_of(self, key_path: str) -> int | None:
        """The line of `key_path`, or of its nearest enclosing table."""
        parts = key_path.split(".")
        while parts:
            line = self.lines.get(".".join(parts))
            if line is not None:
                return line
            parts.pop()
        return None

    def error(self, key_path: str, message: str, value: Any = ..., ) -> SpecError:
        """A one-line SpecError naming the file, the line and the key path."""
        line = self.line_of(key_path) if key_path else None
        where = f"{self.path}:{line}" if line else f"{self.path}"
        shown = "" if value is ... else f" = {_show(value)}"
        subject = f"{key_path}{shown}: " if key_path else ""
        return SpecError(f"{where}: {subject}{message}")

    def resolve(self, relative: str) -> Path:
        """A path from the spec, relative to the spec file."""
        candidate = Path(relative).expanduser()
        return candidate if candidate.is_absolute() else (self.base_dir / candidate)


@dataclass(frozen=True)
class LoadedSpec:
    spec: Spec
    source: SpecSource

    @property
    def sha256(self) -> str:
        return spec_sha256(self.spec)


def spec_sha256(spec: Spec) -> str:
    """A digest of the validated spec (stable under comments, whitespace and key order)."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_spec(path: str | Path) -> LoadedSpec:
    """Read, parse and validate a spec file. Raises SpecError with one line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read the spec: {exc}") from None
    return parse_spec(text, path)


def parse_spec(text: str, path: Path) -> LoadedSpec:
    source = SpecSource(path=path, text=text, lines=_key_lines(text))
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}:{_toml_error_line(exc)}: malformed TOML: {_toml_error_text(exc)}") from None
    except RecursionError:
        raise SpecError(f"{path}: malformed TOML: arrays or tables nested too deeply") from None
    try:
        spec = Spec.model_validate(raw)
    except ValidationError as exc:
        raise _first_error(exc, raw, source) from None
    _check_adapter_names(spec, source)
    return LoadedSpec(spec=spec, source=source)


def _check_adapter_names(spec: Spec, source: SpecSource) -> None:
    """Clients select an adapter by its name, so a name may serve one adapter only, and not the base."""
    first: dict[str, int] = {}
    for index, adapter in enumerate(spec.adapters):
        key = f"adapters.{index}.name"
        if adapter.name == spec.model.id:
            raise source.error(key, "is the base model's id; clients could not tell the two apart", adapter.name)
        if adapter.name in first:
            raise source.error(key, f"repeats adapters.{first[adapter.name]}.name; each adapter needs its own name",
                               adapter.name)
        first[adapter.name] = index


def _first_error(exc: ValidationError, raw: dict, source: SpecSource) -> SpecError:
    err = exc.errors(include_url=False)[0]
    loc = [str(part) for part in err["loc"]]
    key_path = ".".join(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        section = ".".join(loc[:-1])
        allowed = _allowed_keys(loc[:-1])
        hint = f"; allowed keys{' in [' + section + ']' if section else ''}: {', '.join(allowed)}" if allowed else ""
        return source.error(key_path, f"unknown key{hint}")
    if kind == "missing":
        return source.error(key_path, "required key is missing")
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    value = _lookup(raw, loc)
    return source.error(key_path, message, value if value is not _MISSING else ...)


_MISSING = object()


def _lookup(raw: Any, loc: list[str]) -> Any:
    node = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return _MISSING
    if isinstance(node, dict):
        return _MISSING
    return node


def _allowed_keys(loc: list[str]) -> list[str]:
    model: Any = Spec
    for part in loc:
        if part.isdigit():  # an entry of an [[array]] table: its model is the list's
            continue
        field_info = model.model_fields.get(part)
        if field_info is None:
            return []
        model = _section_model(field_info.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _section_model(annotation: Any) -> Any:
    """The spec model a field holds: itself, or inside `X | None` and `list[X]`."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    return next((arg for arg in typing.get_args(annotation)
                 if isinstance(arg, type) and hasattr(arg, "model_fields")), None)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, bool)) else repr(value)


def _key_lines(text: str) -> dict[str, int]:
    """Map dotted key paths to 1-based lines, for `[table]` headers and `key =` lines."""
    lines: dict[str, int] = {}
    table: list[str] = []
    entries: dict[str, int] = {}  # [[array]] tables seen so far: their keys are array.<index>.key
    for number, line in enumerate(text.splitlines(), start=1):
        array = _ARRAY_TABLE.match(line)
        if array:
            name = array.group(1).strip().strip('"')
            index = entries[name] = entries.get(name, -1) + 1
            table = [name, str(index)]
            lines.setdefault(name, number)
            lines.setdefault(f"{name}.{index}", number)
            continue
        header = _TABLE.match(line)
        if header and not line.lstrip().startswith("[["):
            table = [part.strip().strip('"') for part in header.group(1).split(".")]
            lines.setdefault(".".join(table), number)
            continue
        key = _KEY.match(line)
        if key:
            name = key.group(1).strip('"')
            lines.setdefault(".".join([*table, name]), number)
    return lines


def _toml_error_line(exc: Exception) -> int:
    lineno = getattr(exc, "lineno", None)
    if lineno:
        return int(lineno)
    match = re.search(r"line (\d+)", str(exc))
    return int(match.group(1)) if match else 1


def _toml_error_text(exc: Exception) -> str:
    msg = getattr(exc, "msg", None) or str(exc)
    return re.sub(r"\s*\(at line \d+, column \d+\)", "", msg).strip()
