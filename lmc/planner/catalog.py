"""The built-in catalogs: model facts and hardware facts, read from the data files beside this module.

Models are a cache of published config.json files, one directory each,
data/models/<org>--<name>/ (lower case): the model's config.json as the Hub publishes it, read by the
same rules as any checkpoint's (planner/architecture.py), and model.toml with its id, aliases, where
the config came from, the published parameter count, and what the published checkpoint holds where the
config cannot say it. Instance families live one per file in data/hardware/<family>.toml, with
per-device figures in data/hardware/accelerators.toml. Every file carries its `source`. Parsed files are cached; a lookup by canonical name reads one file,
so `lmc plan` stays fast. The only fact read from the machine is the local target's RAM.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lmc.errors import InternalError, SpecValueError
from lmc.planner.checkpoint_facts import Answer, Weights, facts_from_answer, read_config
from lmc.planner.facts import HardwareFacts, ModelFacts
from lmc.schema.units import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DATA_DIR = Path(__file__).parent / "data"
MODELS_DIR = DATA_DIR / "models"
HARDWARE_DIR = DATA_DIR / "hardware"
_ACCELERATORS_FILE = HARDWARE_DIR / "accelerators.toml"
_LOCAL_FILE = HARDWARE_DIR / "local.toml"
_NOT_FAMILIES = {"accelerators", "local"}
_SIZE_FIELDS = ("device_memory_bytes", "host_memory_bytes", "instance_storage_bytes")


# --- models -------------------------------------------------------------------------------------

def model_facts(model_id: str) -> ModelFacts:
    """The catalog's facts for `model_id`: case-insensitive, with or without the org prefix, or an alias."""
    return _model_from_config_dir(*_entry(model_id))


def list_models() -> list[str]:
    """The canonical ids of every catalog model, sorted case-insensitively."""
    return sorted((facts.id for facts in _all_models()), key=str.lower)


def has_model(model_id: str) -> bool:
    """Whether the catalog holds `model_id` (an id, alias or name without its org)."""
    return model_id.strip().lower() in _model_index()


def model_answer(model_id: str) -> Answer:
    """The catalog's entry for `model_id` as a source's answer (lmc/model_sources.py)."""
    return _config_dir_answer(*_entry(model_id))


def _entry(model_id: str) -> tuple[Path, str]:
    """(directory, name as shown) of the catalog's entry for `model_id`, or a one-line error."""
    key = model_id.strip().lower()
    match = _model_index().get(key)
    if match is None:
        raise SpecValueError("model.id", model_id, _unknown_model_message(key))
    return match[1], match[0]


@functools.cache
def _model_from_config_dir(path: Path, name: str) -> ModelFacts:
    return facts_from_answer(_config_dir_answer(path, name))


def _config_dir_answer(path: Path, name: str) -> Answer:
    """A cached published config.json, read as a checkpoint's config is, with what model.toml records of the
    published checkpoint: its safetensors element counts per dtype ([safetensors]), else its count and dtype
    where the config cannot give them ([checkpoint])."""
    meta = _read_toml(path / "model.toml")
    source = f"catalog {path.name}/config.json: {meta.get('config_source', 'published config.json')}"
    checkpoint = meta.get("checkpoint") or {}
    counts = (meta.get("safetensors") or {}).get("parameters") or {}
    if counts:
        weights = Weights([(f"{dtype} tensors", dtype, (int(count),)) for dtype, count in sorted(counts.items())],
                          f"; parameters: the checkpoint's safetensors metadata "
                          f"({(meta.get('safetensors') or {}).get('source', 'Hub')})")
    elif "parameters" in checkpoint:
        weights = Weights(None, f"; parameters: {checkpoint.get('source', 'the published checkpoint')}")
    else:
        weights = Weights(None, "; parameters: computed from config.json as transformers builds it")
    return Answer(model_id=name, config=read_config(path / "config.json"), config_file=path / "config.json",
                  source=source, weights=lambda: weights,
                  stated={key: checkpoint[key] for key in ("parameters", "torch_dtype") if key in checkpoint})


def _config_dir_ids(path: Path) -> tuple[str, list[str]]:
    meta = _read_toml(path / "model.toml")
    return str(meta["id"]), [str(alias) for alias in meta.get("aliases", [])]


@functools.cache
def _all_models() -> tuple[ModelFacts, ...]:
    return tuple(_model_from_config_dir(path, _config_dir_ids(path)[0]) for path in _config_dirs())


@functools.cache
def _config_dirs() -> tuple[Path, ...]:
    """Catalog entries: published config.json files, one directory each, with model.toml."""
    return tuple(path for path in sorted(MODELS_DIR.iterdir()) if (path / "config.json").is_file())


@functools.cache
def _model_index() -> dict[str, tuple[str, Path]]:
    """Lower-cased name -> (name as shown, directory): ids, aliases, and names without the org prefix."""
    index: dict[str, tuple[str, Path]] = {}
    short: dict[str, list[tuple[str, Path]]] = {}
    for path in _config_dirs():
        model_id, aliases = _config_dir_ids(path)
        for name in [model_id, *aliases]:
            if name.lower() in index and index[name.lower()][1] != path:
                raise InternalError(f"catalog name {name!r} is claimed by {index[name.lower()][1].name} and {path.name}")
            index[name.lower()] = (name, path)
            if "/" in name:
                short.setdefault(name.split("/", 1)[1].lower(), []).append((name, path))
    for key, matches in short.items():
        if key not in index and len({path for _, path in matches}) == 1:
            index[key] = matches[0]
    return index


def _unknown_model_message(key: str) -> str:
    names = [facts.id for facts in _all_models()]
    lowered = {name.lower(): name for name in names}
    lowered.update({name.split("/", 1)[1].lower(): name for name in names})
    close = difflib.get_close_matches(key, list(lowered), n=1, cutoff=0.6)
    if close:
        return (f"not in the built-in catalog; did you mean {lowered[close[0]]}? "
                "(or give model.path, a local checkpoint)")
    return "not in the built-in catalog; give model.path (a local checkpoint) or one of: " + ", ".join(sorted(names, key=str.lower))


# --- hardware -----------------------------------------------------------------------------------

def hardware_facts(instance: str) -> HardwareFacts:
    """The facts of a catalog instance ("ml.g5.12xlarge" or "g5.12xlarge"), or of "local"."""
    key = instance.strip().lower()
    if key == "local":
        return local_facts()
    canonical = key if key.startswith("ml.") else f"ml.{key}"
    family = canonical.split(".")[1] if canonical.count(".") >= 2 else ""
    path = HARDWARE_DIR / f"{family}.toml"
    if re.fullmatch(r"[a-z0-9]+", family) and family not in _NOT_FAMILIES and path.is_file():
        facts = _family_instances(path).get(canonical)
        if facts is not None:
            return facts
    raise SpecValueError("target.instance", instance, _unknown_instance_message(canonical))


def list_instances() -> list[str]:
    """Every catalog instance name (ml.* form), sorted; "local" is always accepted besides these."""
    return sorted(name for path in _family_files() for name in _family_instances(path))


def list_accelerators() -> list[str]:
    """Every catalog accelerator name, sorted."""
    return sorted(_accelerators())


def accelerator_facts(accelerator: str, devices: int) -> HardwareFacts:
    """Facts for `devices` of a catalog accelerator in one host joined by its default interconnect (PCIe)."""
    name = _accelerator_name(accelerator)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise SpecValueError("target.devices", devices, "must be a whole number of devices, at least 1")
    entry = _accelerators()[name]
    return _build_hardware(
        {**entry, "name": f"{devices}x {name}", "accelerator": name, "devices": devices, "price_per_hour": None,
         "source": f"accelerator target: {devices} x {name} in one host over {entry['interconnect']['name']} "
                   f"(no instance, so no price); device: {entry['source']}"},
        where=_ACCELERATORS_FILE,
    )


def local_facts() -> HardwareFacts:
    """The CPU of this machine as one device whose memory is the machine's RAM."""
    ram = _total_ram_bytes()
    data = {**_read_toml(_LOCAL_FILE), "device_memory_bytes": ram, "host_memory_bytes": ram}
    return _build_hardware(data, where=_LOCAL_FILE)


def profile_facts(path: Path) -> HardwareFacts:
    """A measured hardware profile: a catalog entry in one TOML file, optionally over a `base` target.

    `base` names a catalog instance or "local" whose facts the profile's keys override; without it
    every HardwareFacts field is required. Errors are one line under the key `target.profile`.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecValueError("target.profile", str(path), "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecValueError("target.profile", str(path), f"not valid TOML: {exc}") from None
    except RecursionError:
        raise SpecValueError("target.profile", str(path), "not valid TOML: arrays or tables nested too deeply") from None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, a NUL in the path
        raise SpecValueError("target.profile", str(path), f"cannot be read: {exc}") from None
    base_name = data.pop("base", None)
    merged: dict[str, Any] = {}
    if base_name is not None:
        if not isinstance(base_name, str):
            raise SpecValueError("target.profile", str(path), f"base must be a catalog instance name, got {base_name!r}")
        try:
            base = hardware_facts(base_name)
        except SpecValueError as exc:
            raise SpecValueError("target.profile", str(path), f"base: {exc.detail}") from None
        merged = base.model_dump()
        merged["source"] = f"measured profile {path} over {base.name}"
    merged.update(data)
    merged.setdefault("source", f"measured profile {path}")
    try:
        return HardwareFacts(**_parse_sizes(merged, path))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError; so are bad sizes
        message = _first_error(exc) if isinstance(exc, ValidationError) else str(exc)
        raise SpecValueError("target.profile", str(path), message) from None


def _build_hardware(data: dict[str, Any], where: Path) -> HardwareFacts:
    data = {key: value for key, value in data.items() if key != "aliases"}
    try:
        return HardwareFacts(**_parse_sizes(data, where))
    except ValueError as exc:
        detail = _first_error(exc) if isinstance(exc, ValidationError) else str(exc)
        raise InternalError(f"catalog file {where} is invalid: {detail}") from None


def _parse_sizes(data: dict[str, Any], where: Path) -> dict[str, Any]:
    parsed = dict(data)
    for key in _SIZE_FIELDS:
        if isinstance(parsed.get(key), str):
            try:
                parsed[key] = parse_size(parsed[key])
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
    return parsed


@functools.cache
def _accelerators() -> dict[str, dict[str, Any]]:
    return _read_toml(_ACCELERATORS_FILE)


@functools.cache
def _accelerator_aliases() -> dict[str, str]:
    aliases = {name: name for name in _accelerators()}
    for name, entry in _accelerators().items():
        for alias in entry.get("aliases", []):
            aliases[alias.lower()] = name
    return aliases


def _accelerator_name(accelerator: str) -> str:
    key = accelerator.strip().lower()
    name = _accelerator_aliases().get(key)
    if name is not None:
        return name
    close = difflib.get_close_matches(key, list(_accelerator_aliases()), n=1, cutoff=0.5)
    hint = f"did you mean {_accelerator_aliases()[close[0]]}?" if close else "known: " + ", ".join(sorted(_accelerators()))
    raise SpecValueError("target.accelerator", accelerator, f"unknown accelerator; {hint}")


@functools.cache
def _family_files() -> tuple[Path, ...]:
    return tuple(path for path in sorted(HARDWARE_DIR.glob("*.toml")) if path.stem not in _NOT_FAMILIES)


@functools.cache
def _family_instances(path: Path) -> dict[str, HardwareFacts]:
    """Every instance of one family file, built over its accelerator's per-device facts."""
    family = dict(_read_toml(path))
    instances = family.pop("instances", [])
    family.pop("family", None)
    accelerator = family.get("accelerator")
    if accelerator not in _accelerators():
        raise InternalError(f"catalog file {path} names accelerator {accelerator!r}, which accelerators.toml lacks")
    device = _accelerators()[accelerator]
    built = {}
    for instance in instances:
        data = {**device, **family, **instance}
        data["source"] = f"{instance.get('source', family['source'])}; device: {device['source']}"
        facts = _build_hardware(data, where=path)
        built[facts.name.lower()] = facts
    return built


def _unknown_instance_message(canonical: str) -> str:
    names = [name for path in _family_files() for name in _family_instances(path)]
    close = difflib.get_close_matches(canonical, names, n=5, cutoff=0.6)
    if close:
        # difflib ties ml.g5.13xlarge between 12xlarge and 16xlarge; the nearer size is the better guess.
        best = max(close, key=lambda name: (round(difflib.SequenceMatcher(None, canonical, name).ratio(), 6),
                                            -abs(_size_number(name) - _size_number(canonical))))
        return f"unknown instance; did you mean {best}?"
    families = sorted({name.split(".")[1] for name in names})
    return ("unknown instance; the catalog has the families " + ", ".join(families)
            + ' (e.g. ml.g5.12xlarge), or use "local", or `accelerator` with `devices`')


def _size_number(name: str) -> int:
    """12 for ml.g5.12xlarge, 1 for ml.g5.xlarge, 0 where the name has no size."""
    match = re.search(r"\.(\d*)xlarge$", name)
    if not match:
        return 0
    return int(match.group(1) or 1)


def _total_ram_bytes() -> int:
    # /proc/meminfo first (what Linux reports to containers too); sysconf where there is no /proc.
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- shared -------------------------------------------------------------------------------------

@functools.cache
def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as stream:
            return tomllib.load(stream)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InternalError(f"catalog file {path} cannot be read: {exc}") from None


def _first_error(exc: ValidationError | ValueError) -> str:
    if not isinstance(exc, ValidationError):
        return str(exc)
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    extra = f" ({len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    if error["type"] == "value_error":  # a validator's own message, which names its keys
        return f"{error['ctx']['error']}{extra}" if not where else f"{where}: {error['ctx']['error']}{extra}"
    return f"{where}: {error['msg']}{extra}"
