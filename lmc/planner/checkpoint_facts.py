"""Model facts from a config.json and a safetensors tensor list, wherever they were read.

Every source of a model's facts (lmc/model_sources.py: a local checkpoint, the Hub, the HF cache, the
catalog) answers with an `Answer`: the config dict, where it came from, and its weights' tensors.
`facts_from_answer` is the one place such an answer becomes `ModelFacts`: the config's fields by
planner/architecture.py's rules (`facts_from_config`), then the tensors (`with_tensors`).

This module also reads a local checkpoint (`local_answer`): its config.json and its safetensors
headers, nothing else. A safetensors file is an 8-byte little-endian header length, a JSON header
naming every tensor's dtype, shape and byte range, then the raw data. Reading the headers gives the
exact parameter count and the stored dtype of a checkpoint of any size in milliseconds; tensor data
is never read.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from lmc.errors import CheckpointError
from lmc.planner.architecture import facts_from_config
from lmc.planner.facts import ModelFacts
from lmc.safetensors_header import DTYPES as ST_DTYPES, HeaderError, read_header

# safetensors dtype -> lmc dtype name.
_ST_DTYPE = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F8_E4M3": "fp8", "F8_E5M2": "fp8", "I8": "int8"}


Tensor = tuple[str, str, tuple[int, ...]]  # a safetensors tensor: name, dtype ("BF16"), shape


@dataclass(frozen=True)
class Weights:
    """A checkpoint's weights as a source read them."""

    tensors: Sequence[Tensor] | None  # None: none read (the parameters are the config's)
    note: str = ""  # what the facts' `source` adds about them


@dataclass(frozen=True)
class Answer:
    """What one source found of a model: its config.json, where it came from, and its weights."""

    model_id: str  # the id the facts carry
    config: dict[str, Any]
    config_file: Path | str  # what an error in the config names
    source: str  # where the facts came from (ModelFacts.source, before the weights' note)
    # Read after the config is checked: a bad config is the first error a user sees, as from a checkpoint.
    weights: Callable[[], Weights]
    stated: dict[str, Any] = field(default_factory=dict)  # facts the source states outright, set last


def facts_from_answer(answer: Answer) -> ModelFacts:
    """The ModelFacts of a source's answer: the config's fields (architecture.py), then its tensors."""
    facts = facts_from_config(answer.config, answer.model_id, source=answer.source, config_file=answer.config_file)
    weights = answer.weights()
    if weights.tensors is not None:
        facts = with_tensors(facts, list(weights.tensors))
    return facts.model_copy(update={**answer.stated, "source": answer.source + weights.note})


def checkpoint_model_facts(path: Path, model_id: str) -> ModelFacts:
    """The facts of the HF checkpoint in directory `path`: dims from config.json, counts from headers."""
    return facts_from_answer(local_answer(path, model_id))


def local_answer(path: Path, model_id: str) -> Answer:
    """The HF checkpoint in directory `path` as a source's answer: its config.json, its safetensors headers."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    config = read_config(path / "config.json")
    return Answer(model_id=model_id, config=config, config_file=path / "config.json", source=str(path),
                  weights=lambda: _local_weights(path))


def _local_weights(path: Path) -> Weights:
    files = safetensors_files(path)
    if not files:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            return Weights(None, " (config.json; parameter count estimated from its dimensions: the weights "
                                 "are pickle *.bin files, which lmc does not read and refuses to build from unless "
                                 "--allow-pickle)")
        raise CheckpointError(f"{path}: no *.safetensors weights (pickle *.bin checkpoints are refused unless --allow-pickle)")
    tensors = [entry for file in files for entry in read_safetensors_header(file)]
    if not tensors:
        raise CheckpointError(f"{files[0]}: the safetensors files hold no tensors")
    return Weights(tensors)


def with_tensors(facts: ModelFacts, tensors: list[Tensor]) -> ModelFacts:
    """`facts` made exact by the checkpoint's tensors (name, safetensors dtype, shape): the parameter
    count and stored dtype of a 16/32-bit checkpoint, the weight bytes of a quantized one (whose
    packed elements and scales are not parameters: its count stays the config's)."""
    parameters, weight_bytes, dtype_elements = 0, 0, Counter()
    for _, dtype, shape in tensors:
        count = math.prod(shape)
        parameters += count
        weight_bytes += count * (ST_DTYPES[dtype].size if dtype in ST_DTYPES else 2)
        if dtype in _ST_DTYPE and _ST_DTYPE[dtype] in ("fp32", "fp16", "bf16"):
            dtype_elements[_ST_DTYPE[dtype]] += count
    update: dict[str, Any] = {}
    if facts.checkpoint_quantization is None:
        update["parameters"] = parameters
    else:
        update["checkpoint_weight_bytes"] = weight_bytes
    if dtype_elements:
        update["torch_dtype"] = dtype_elements.most_common(1)[0][0]
    if facts.expert_parameters and facts.checkpoint_quantization is None:
        # The experts are the config's (their shapes are exact); what the exact total adds is outside them.
        experts = facts.expert_parameters
        update["active_parameters"] = parameters - experts + experts * facts.experts_per_token // facts.num_experts
    return facts.model_copy(update=update)


def read_config(config_file: Path) -> dict[str, Any]:
    """config.json as a dict, or a one-line CheckpointError naming the file."""
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing (a HF checkpoint directory needs its config.json)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({_one_line(exc)})") from None
    except RecursionError:
        raise CheckpointError(f"{config_file}: not valid JSON (nested too deeply)") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    return config


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names when sharded, else every *.safetensors."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to file names")
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CheckpointError(f"{index_file}: not a safetensors index (needs a `weight_map` object): "
                                  f"{_one_line(exc)}") from None
        files = [path / name for name in names]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (listed in {index_file.name})")
        return files
    files = sorted(path.glob("*.safetensors"))
    for file in files:  # a fifo or a device would block the header read forever
        if not file.is_file():
            raise CheckpointError(f"{file}: not a regular file")
    # Without an index, shard names say how many there are: a partial download must not plan as a
    # smaller model (its headers hold only part of the parameters).
    for file in files:
        match = re.fullmatch(r"(.*)-(\d+)-of-(\d+)\.safetensors", file.name)
        if match:
            stem, width, total = match.group(1), len(match.group(2)), int(match.group(3))
            for number in range(1, total + 1):
                sibling = path / f"{stem}-{number:0{width}d}-of-{match.group(3)}.safetensors"
                if not sibling.is_file():
                    raise CheckpointError(f"{sibling}: missing ({file.name} says the checkpoint has {total} shards)")
    return files


def read_safetensors_header(file: Path) -> list[Tensor]:
    """(name, dtype, shape) of every tensor in `file`, checked against the file size; data never read."""
    try:
        header = read_header(file)
    except HeaderError as exc:
        raise CheckpointError(f"{file}: corrupt safetensors file: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc.strerror or exc}") from None
    return [(name, entry.dtype, entry.shape) for name, entry in header.tensors.items()]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
