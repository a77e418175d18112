"""The spec schema: strict models, size units, key-path lines, the committed JSON Schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmc.errors import SpecError
from lmc.schema import load_spec, parse_size, parse_spec
from lmc.schema.docs import DOC_PATH, spec_reference
from lmc.schema.export import SCHEMA_PATH, spec_json_schema
from lmc.schema.units import format_bytes

SPECS = sorted((Path(__file__).parents[1] / "specs").glob("*.toml"))


@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29),
     ("100 MB", 10**8), ("7", None), (4096, 4096)],
)
def test_parse_size(text, expected):
    if expected is None:
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(text)
    else:
        assert parse_size(text) == expected


def test_gib_and_gb_differ():
    assert parse_size("24GiB") - parse_size("24GB") == 24 * (2**30 - 10**9)


@pytest.mark.parametrize("bad", [0, -1, True, "0GiB", "-3GiB", "GiB", "3 GiBs"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_bytes():
    assert format_bytes(12_100_000_000) == "11.3 GiB"
    assert format_bytes(512) == "512 B"


def test_committed_json_schema_is_current():
    assert SCHEMA_PATH.read_text() == spec_json_schema(), "run `python -m lmc.schema.export`"


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_example_specs_validate(path):
    loaded = load_spec(path)
    assert loaded.spec.model.id
    assert len(loaded.sha256) == 64


def test_spec_digest_ignores_comments_and_order(tmp_path):
    a = parse_spec('[model]\nid = "x"\n[target]\ninstance = "local"\n', tmp_path / "a.toml")
    b = parse_spec('# hi\n[target]\ninstance = "local"\n\n[model]\nid = "x"  # same\n', tmp_path / "b.toml")
    c = parse_spec('[model]\nid = "y"\n[target]\ninstance = "local"\n', tmp_path / "c.toml")
    assert a.sha256 == b.sha256 != c.sha256


def test_defaults_are_unset_not_invented(tmp_path):
    spec = parse_spec('[model]\nid = "x"\n[target]\ninstance = "local"\n', tmp_path / "s.toml").spec
    assert spec.pin.engine is None and spec.pin.tensor_parallel_degree is None
    assert spec.budget.memory_per_device is None and spec.goal.tpot_ms is None
    assert spec.target.instances == 1 and spec.budget.memory_fraction == 0.9


def test_sizes_parse_inside_spec(tmp_path):
    spec = parse_spec('[model]\nid = "x"\n[target]\ninstance = "local"\n[budget]\nmemory_per_device = "20GiB"\n',
                      tmp_path / "s.toml").spec
    assert spec.budget.memory_per_device == 20 * 2**30


def test_error_names_nested_line(tmp_path):
    text = '[model]\nid = "x"\n\n[target]\ninstance = "local"\n\n[workload]\nmax_output_tokens = 0\n'
    with pytest.raises(SpecError) as exc:
        parse_spec(text, tmp_path / "s.toml")
    assert str(exc.value) == (
        f"{tmp_path / 's.toml'}:8: workload.max_output_tokens = 0: Input should be greater than or equal to 1"
    )


def test_unreadable_spec(tmp_path):
    path = tmp_path / "bin.toml"
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(path)


def test_committed_spec_reference_is_current():
    assert DOC_PATH.read_text() == spec_reference(), "run `python -m lmc.schema.docs`"


def test_every_spec_key_has_a_description_and_appears_in_the_reference():
    from lmc.schema.spec import Spec
    from lmc.schema.docs import _section_shape

    text = DOC_PATH.read_text()
    schema = Spec.model_json_schema()
    for section, prop in schema["properties"].items():
        model, many = _section_shape(prop, schema["$defs"])
        heading = f"[[{section}]]" if many else f"[{section}]"
        assert f"## `{heading}`" in text, heading
        assert model.get("description"), f"{heading}: the model needs a docstring (the section's intro)"
        for key, field in model["properties"].items():
            assert len(field.get("description", "")) >= 20, f"{section}.{key}: give it a one-line description"
            assert f"- **`{key}`** (" in text, f"{section}.{key}"


def test_the_reference_example_is_a_spec_that_plans(tmp_path):
    from lmc.pipeline import plan_from_spec
    from lmc.schema.docs import EXAMPLE

    path = tmp_path / "example.toml"
    path.write_text(EXAMPLE)
    plan = plan_from_spec(load_spec(path)).plan
    assert (plan.engine, plan.vllm.tool_call_parser, plan.vllm.reasoning_parser) == ("vllm", "hermes", "qwen3")
    assert plan.goal_met


def test_the_reference_walks_any_section_shape():
    """Repeatable sections ([[name]]), optional ones (`X | None`) and tables inside a section appear with
    their keys and an example built from the keys' own, without naming them in the generator."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class Source(Strict):
        """Where the weights come from."""
        uri: str = Field(examples=["s3://bucket/x"], description="Where the weights are.")

    class Adapter(Strict):
        """A LoRA adapter served beside the base model."""
        name: str = Field(examples=["sql"], description="The name clients send as `model`.")
        rank: int = Field(default=8, ge=1, le=512, description="The adapter's rank.")
        source: Source | None = Field(default=None, description="Where it comes from.")

    class Speculative(Strict):
        """Speculative decoding."""
        method: Literal["ngram", "draft"] = Field(description="How tokens are proposed.")

    class Toy(Strict):
        """A spec."""
        adapters: list[Adapter] = []
        speculative: Speculative | None = None

    text = spec_reference(Toy, example="[[adapters]]\nname = \"sql\"\n")
    assert "## `[[adapters]]`\n\n*optional, repeatable*\n\nA LoRA adapter served beside the base model." in text
    assert '```toml\n[[adapters]]\nname = "sql"\n```' in text  # the example's own part
    assert "- **`rank`** (integer, default `8`): The adapter's rank.\n  Constraints: ≥ 1, ≤ 512." in text
    assert "- **`source`** (table, unset): Where it comes from." in text
    assert "## `[adapters.source]`" in text and '```toml\n[adapters.source]\nuri = "s3://bucket/x"\n```' in text
    assert "## `[speculative]`\n\n*optional*" in text
    assert '```toml\n[speculative]\nmethod = "ngram"\n```' in text  # built: the first allowed value
    assert '- **`method`** (one of `"ngram"`, `"draft"`, required): How tokens are proposed.' in text


def test_adapters_and_speculative_parse_with_entry_lines(tmp_path):
    text = ('[model]\nid = "meta-llama/Llama-3.1-8B"\n[target]\ninstance = "ml.g5.2xlarge"\n'
            '[[adapters]]\nname = "sql"\npath = "adapters/sql"\n'
            '[[adapters]]\nname = "chat"\nid = "org/chat-lora"\nrevision = "v1"\n'
            '[speculative]\nmethod = "eagle3"\nnum_tokens = 3\nmodel = "org/eagle3"\n')
    loaded = parse_spec(text, tmp_path / "s.toml")
    assert [a.name for a in loaded.spec.adapters] == ["sql", "chat"]
    assert loaded.spec.adapters[1].revision == "v1" and loaded.spec.adapters[0].id is None
    assert loaded.spec.speculative.method == "eagle3" and loaded.spec.speculative.acceptance_rate is None
    assert loaded.source.line_of("adapters.1.id") == 10
    assert loaded.source.line_of("adapters.0") == 5
    assert loaded.source.line_of("speculative.model") == 15


def test_adapter_name_may_not_be_the_base_id(tmp_path):
    text = ('[model]\nid = "base-model"\n[target]\ninstance = "ml.g5.2xlarge"\n'
            '[[adapters]]\nname = "base-model"\npath = "a"\n')
    with pytest.raises(SpecError) as exc:
        parse_spec(text, tmp_path / "s.toml")
    assert str(exc.value) == (f'{tmp_path / "s.toml"}:6: adapters.0.name = "base-model": is the base model\'s id; '
                              "clients could not tell the two apart")
