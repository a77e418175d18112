"""The user documentation in docs/ says what the code does: every plan field is described, and nothing
a user needs points outside the repository."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from lmc.planner.plan import Plan

ROOT = Path(__file__).parents[1]


def _plan_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field path of the plan's JSON: `model.experts.routed`, `decisions[].key`."""
    paths = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        nested = _nested_model(field.annotation)
        if nested is not None:
            inner, many = nested
            paths.extend(_plan_fields(inner, prefix + name + ("[]." if many else ".")))
    return paths


def _nested_model(annotation) -> tuple[type[BaseModel], bool] | None:
    """The model a field holds (`X`, `X | None`, `list[X]`), and whether it is a list of them."""
    if typing.get_origin(annotation) is list:
        inner = _nested_model(typing.get_args(annotation)[0])
        return (inner[0], True) if inner else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    for option in typing.get_args(annotation):  # X | None
        if isinstance(option, type) and issubclass(option, BaseModel):
            return option, False
    return None


def test_docs_plan_describes_every_plan_field():
    text = (ROOT / "docs" / "plan.md").read_text()
    described = set(re.findall(r"^\| `([^`]+)` \|", text, re.MULTILINE))
    fields = _plan_fields(Plan)
    assert len(fields) > 80  # the walk reached the nested sections
    missing = [path for path in fields if path not in described]
    assert missing == [], f"docs/plan.md does not describe {missing}"
    assert described - set(fields) == set(), "docs/plan.md describes fields the plan does not have"


def test_nothing_a_user_needs_lives_outside_the_repository():
    """The contracts (spec, plan, exit codes) are in docs/, not in a design file beside the repository."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "lmc").rglob("*.py"))]
    pointing_out = [str(p.relative_to(ROOT)) for p in pages
                    if re.search(r"DESIGN\.md|\.\./shared", p.read_text(encoding="utf-8"))]
    assert pointing_out == []


def test_the_readmes_counts_are_the_repositorys():
    """The README's counts of example specs, catalog configs and bad specs follow the files (they drifted: 40
    specs and 44 bad specs were once stated where there were 42 and 58)."""
    from lmc.planner import catalog

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    specs = len(list((ROOT / "specs").glob("*.toml")))
    assert int(re.search(r"`specs/` holds (\d+) more", readme).group(1)) == specs - 1  # besides the one shown
    assert int(re.search(r"catalog of (\d+) published configs", readme).group(1)) == len(catalog.list_models())
    verified = (ROOT / "docs" / "verified.md").read_text(encoding="utf-8")
    bad_specs = len(list((ROOT / "tests" / "bad_specs").glob("*.toml")))
    assert int(re.search(r"unit tests, (\d+) bad specs", verified).group(1)) == bad_specs
