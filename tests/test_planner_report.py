"""The text report: bars, goal marks, width, explain."""

from __future__ import annotations

import re

from lmc.planner import catalog, plan_deployment
from lmc.planner.engines import reference_model
from lmc.planner.report import render_plan
from lmc.schema.spec import Spec

G5 = catalog.hardware_facts("ml.g5.12xlarge")


def _plan(goal):
    spec = Spec.model_validate({"model": {"id": "x"}, "target": {"instance": "ml.g5.12xlarge"}, "goal": goal})
    return spec, plan_deployment(spec, reference_model("gpt-j-6b"), G5, spec_sha256="0" * 64, lmc_version="0.1.0")


def test_report_has_memory_bars_and_goal_marks():
    spec, plan = _plan({"tpot_ms": 50, "ttft_ms": 1})
    text = render_plan(plan, spec)
    weights_line = next(line for line in text.splitlines() if line.strip().startswith("weights"))
    assert "█" in weights_line and "░" in weights_line and weights_line.endswith("GiB")
    assert "✓ goal 50 ms" in text  # TPOT met
    assert "✗ goal 1 ms" in text  # TTFT of 1 ms cannot be met
    assert "goal met    NO" in text
    assert f"TP {plan.tensor_parallel_degree}" in text


def test_report_width_and_stability():
    spec, plan = _plan({"tpot_ms": 50})
    for explain in (False, True):
        text = render_plan(plan, spec, explain=explain)
        assert max(len(line) for line in text.splitlines()) <= 100
        assert text == render_plan(plan, spec, explain=explain)


def test_explain_lists_every_decision_and_alternative():
    spec, plan = _plan({"tpot_ms": 50})
    text = render_plan(plan, spec, explain=True)
    for d in plan.decisions:
        assert f"{d.key} = {d.value}" in text
    # One line per alternative, led by its verdict word (whole: "infeasible" holds "feasible"), in order.
    heads = re.findall(r"^  (\w+) +(\S+) (\S+) TP (\d+) × (\d+):", text, re.MULTILINE)
    assert heads == [(a.verdict, a.engine, a.dtype, str(a.tensor_parallel_degree), str(a.replicas))
                     for a in plan.alternatives]
    assert "decisions" in text and "best alternatives" not in text
