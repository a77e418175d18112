"""A plan that misses its goal is visible to scripts: `lmc plan` exits 4 (EXIT_GOAL_MISSED) after printing it,
`lmc build` and `lmc deploy` refuse it with exit 4 unless given --accept-missed-goal. Real CLI subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.errors import EXIT_GOAL_MISSED
from test_planner_goals import QWEN3_G6E_32

ROOT = Path(__file__).resolve().parents[1]
MET = ROOT / "specs" / "gpt-j-6b-deepspeed-p3-16xlarge.toml"

# Qwen3-8B on one L40S at concurrency 32 with a 30 ms TPOT goal: no layout meets it (issue 31).
MISSED = QWEN3_G6E_32.format(instances=1)

# The tiny CPU Llama with a TPOT goal no machine meets.
TINY_MISSED = """
[model]
id = "lmc/tiny-llama"
path = "{path}"

[target]
instance = "local"

[budget]
memory_per_device = "4GiB"

[goal]
tpot_ms = 0.001

[workload]
max_input_tokens = 16
max_output_tokens = 8

[pin]
engine = "hf"
dtype = "fp32"
tensor_parallel_degree = 1
"""


def lmc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmc", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def missed(tmp_path) -> Path:
    path = tmp_path / "missed.toml"
    path.write_text(MISSED, encoding="utf-8")
    return path


def test_plan_exits_4_after_printing_a_plan_that_misses_its_goal(missed, tmp_path):
    result = lmc("plan", str(missed), cwd=tmp_path)
    assert result.returncode == EXIT_GOAL_MISSED == 4
    assert "goal met    NO" in result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmc: the plan misses its goal: no configuration that fits")
    assert lines[0].endswith("(exit 4)")
    as_json = lmc("plan", "--json", str(missed), cwd=tmp_path)
    assert as_json.returncode == 4 and json.loads(as_json.stdout)["goal_met"] is False


def test_plan_exits_0_for_a_plan_that_meets_its_goal(tmp_path):
    result = lmc("plan", "--json", str(MET), cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert json.loads(result.stdout)["goal_met"] is True


def test_deploy_refuses_a_missed_goal_unless_accepted(missed, tmp_path):
    refused = lmc("deploy", str(missed), "--target", "sagemaker", "-o", "out", cwd=tmp_path)
    assert refused.returncode == 4
    assert refused.stderr.startswith("lmc: error: the plan misses its goal: ")
    assert "pass --accept-missed-goal to deploy it anyway" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()
    accepted = lmc("deploy", str(missed), "--target", "sagemaker", "-o", "out", "--accept-missed-goal", cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stderr
    body = json.loads((tmp_path / "out" / "sagemaker" / "create-endpoint-config.json").read_text())
    assert body["ProductionVariants"][0]["InstanceType"] == "ml.g6e.xlarge"


def test_build_refuses_a_missed_goal_before_writing_anything_unless_accepted(tmp_path):
    from lmc.testing.checkpoints import make_checkpoint

    checkpoint = make_checkpoint("llama", tmp_path / "tiny", seed=0)
    spec = tmp_path / "tiny.toml"
    spec.write_text(TINY_MISSED.format(path=checkpoint), encoding="utf-8")
    refused = lmc("build", str(spec), "-o", "model.tar.gz", cwd=tmp_path)
    assert refused.returncode == 4
    assert "pass --accept-missed-goal to build it anyway" in refused.stderr
    assert not (tmp_path / "model.tar.gz").exists()
    accepted = lmc("build", str(spec), "-o", "model.tar.gz", "--accept-missed-goal", cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stderr
    assert (tmp_path / "model.tar.gz").stat().st_size > 0
