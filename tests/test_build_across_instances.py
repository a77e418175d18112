"""Plans across instances build and run on vLLM's multi-node engine only: lmc's own hf pipeline was removed
(issue 23). A plan or artifact that asks for it stops with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmc.errors import ArtifactError

GOLDEN = Path(__file__).parent.parent / "golden"


def _plan(golden: str, **changes):
    from lmc.planner.plan import Plan

    plan = Plan.model_validate(json.loads((GOLDEN / golden / "plan.json").read_text()))
    deployment = plan.deployment.model_copy(update={"pipeline_parallel_degree": 2, "instances": 2})
    return plan.model_copy(update={"deployment": deployment, **changes})


@pytest.mark.parametrize("golden, changes, engine", [
    ("gpt-j-6b-deepspeed-p3-2xlarge", {}, "deepspeed"),
    ("tiny-llama-cpu", {}, "hf"),  # the Llama family lmc's own pipeline used to cut
])
def test_build_refuses_pipeline_plans_of_other_engines(golden, changes, engine):
    from lmc.emitters.build import check_pipeline_plan

    with pytest.raises(ArtifactError) as error:
        check_pipeline_plan(_plan(golden, **changes))
    assert str(error.value) == (f"pipeline parallel degree 2: lmc runs plans across instances on vLLM's multi-node "
                                f"engine only, not {engine} (lmc's own hf pipeline was removed)")
    check_pipeline_plan(_plan("tiny-llama-cpu", engine="vllm"))  # vLLM's multi-node mode: builds


def test_the_runtime_refuses_an_artifact_of_the_removed_pipeline():
    """An artifact built before the removal (hf, two stages; lmc.json's plan) stops `lmc runtime` with the reason."""
    from lmc.cli.runtime import _refuse_lmc_pipeline

    with pytest.raises(ArtifactError) as error:
        _refuse_lmc_pipeline(_plan("tiny-llama-cpu").model_dump(mode="json"))
    assert str(error.value) == ("this artifact splits the model into 2 pipeline stages for lmc's own hf pipeline, "
                                "which was removed: plan and build the spec again (vLLM runs models across instances)")
    _refuse_lmc_pipeline(json.loads((GOLDEN / "tiny-llama-cpu" / "plan.json").read_text()))  # one instance: runs
