"""`lmc plan` end to end: output modes, exit codes, and no heavy imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmc.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
GPTJ = ROOT / "specs" / "gpt-j-6b-deepspeed-p3-16xlarge.toml"
INFEASIBLE = ROOT / "specs" / "bloom-176b-g5-12xlarge.toml"

DESIGN_KEYS = [
    "lmc_version", "spec_sha256", "plan_sha256", "model", "target", "engine", "dtype", "quantization",
    "tensor_parallel_degree", "replicas", "batch_size", "max_batch_delay_ms", "job_queue_size",
    "max_sequence_length", "scheduling", "deployment", "memory_per_device", "predicted", "goal_met", "decisions", "alternatives",
]


def test_plan_json_has_exactly_the_design_keys(capsys):
    assert main(["plan", "--json", str(GPTJ)]) == 0
    plan = json.loads(capsys.readouterr().out)
    # kv_cache only for continuous plans (DESIGN.md), right after scheduling.
    assert plan["scheduling"] == "continuous"  # DeepSpeed at TP > 1: no fused kernels, rows can join
    assert list(plan) == [*DESIGN_KEYS[:15], "kv_cache", *DESIGN_KEYS[15:]]
    assert list(plan["memory_per_device"]) == ["weights", "kv_cache", "activations", "runtime_overhead",
                                               "total", "capacity", "headroom"]
    assert list(plan["predicted"]) == ["ttft_ms", "tpot_ms", "throughput_tokens_per_s", "load_seconds",
                                       "cost_per_hour", "cost_per_million_tokens", "step_times"]
    # Every predicted figure names the model behind it (DESIGN, "Predictions"): a deepspeed plan, lmc's own.
    assert plan["predicted"]["step_times"].startswith("lmc roofline (latency.py); ")
    memory = plan["memory_per_device"]
    assert all(isinstance(v, int) for v in memory.values())
    assert memory["total"] == memory["weights"] + memory["kv_cache"] + memory["activations"] + memory["runtime_overhead"]
    assert memory["headroom"] == memory["capacity"] - memory["total"]
    assert plan["engine"] == "deepspeed"  # pinned in the spec
    assert all({"key", "value", "reason"} == set(d) for d in plan["decisions"])


def test_plan_digest_covers_the_plan(capsys):
    main(["plan", "--json", str(GPTJ)])
    plan = json.loads(capsys.readouterr().out)
    from lmc.planner.plan import Plan

    rebuilt = Plan.model_validate({**plan, "plan_sha256": ""}).with_digest()
    assert rebuilt.plan_sha256 == plan["plan_sha256"]
    tampered = Plan.model_validate({**plan, "batch_size": plan["batch_size"] + 1, "plan_sha256": ""}).with_digest()
    assert tampered.plan_sha256 != plan["plan_sha256"]


def test_human_view_shows_memory_bars_and_goal(capsys):
    assert main(["plan", str(GPTJ)]) == 0
    out = capsys.readouterr().out
    assert "█" in out and "capacity" in out
    assert "goal 50 ms" in out


def test_infeasible_exits_3_and_names_what_would_fit(capsys):
    assert main(["plan", str(INFEASIBLE)]) == 3
    err = capsys.readouterr().err
    assert err.startswith("lmc: no feasible plan: bigscience/bloom fp16 needs 352.5 GB of weights")
    assert "ml.p4de.24xlarge" in err or "ml.p5" in err


SPECS = sorted((ROOT / "specs").glob("*.toml"))


def _expected_exit(spec: Path) -> int:
    """3 where the spec is infeasible by design (its golden is the refusal, plan.txt, not a plan.json), 4 where
    its golden plan misses the goal, else 0."""
    golden = ROOT / "golden" / spec.stem
    assert (golden / "plan.json").is_file() != (golden / "plan.txt").is_file(), golden
    if not (golden / "plan.json").is_file():
        return 3
    return 0 if json.loads((golden / "plan.json").read_text())["goal_met"] else 4


def test_planning_every_spec_leaves_torch_unimported(cpu_checkpoint):
    """Every example spec, those with a local model.path too, planned in one fresh interpreter: each exits
    as designed (a spec that fails to plan would import nothing heavy and prove nothing), and no heavy
    module is imported."""
    code = (
        "import contextlib, io, json, sys\n"
        "from lmc.cli.main import main\n"
        "codes = {}\n"
        "for spec in sys.argv[1:]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        codes[spec] = main(['plan', '--json', spec])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'deepspeed', 'numpy', 'safetensors', 'jinja2')"
        " if m in sys.modules)\n"
        "print(json.dumps({'codes': codes, 'heavy': heavy}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *map(str, SPECS)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["codes"] == {str(spec): _expected_exit(spec) for spec in SPECS}
    assert sorted(_expected_exit(spec) for spec in SPECS).count(3) == 1  # bloom-176b on one ml.g5.12xlarge
    assert any("path =" in spec.read_text() for spec in SPECS)  # local checkpoints are among them
    assert result["heavy"] == []


def test_quantization_reason_names_the_concurrency_it_buys(capsys):
    """GPT-J on one V100: fp16 fits only 1 sequence of the 4 asked for (with the caching allocator's reserve for
    lmc's growing KV pool, lmc.planner.memory.kv_reserve_bytes), so int8 is chosen, and says so."""
    assert main(["plan", "--json", str(ROOT / "specs" / "gpt-j-6b-deepspeed-p3-2xlarge.toml")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["dtype"] == "int8"
    reason = next(d["reason"] for d in plan["decisions"] if d["key"] == "dtype")
    assert "16-bit weights leave room for at most 1 concurrent sequences" in reason
    assert "of the 4 the workload asks for" in reason


def test_a_path_the_system_refuses_is_one_line_not_an_internal_error(tmp_path, capsys):
    """A model path longer than a file name may be (ENAMETOOLONG from the first stat) was exit 70."""
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[model]\nid = "gpt-j-6b"\npath = "{"a" * 300}"\n[target]\ninstance = "ml.g5.12xlarge"\n')
    code = main(["plan", str(spec)])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("lmc: error: ") and err.rstrip().endswith("File name too long") and "INTERNAL" not in err


@pytest.mark.parametrize("name", ["two\nlines.toml", "esc\x1b[2Jape.toml", "bell\x07.toml"])
def test_an_error_naming_a_file_with_control_characters_stays_one_line(tmp_path, capsys, name):
    """A file name (or an archive member, a manifest key) may hold a newline or a terminal escape: the
    error line escapes them as Python writes them, so it stays one line and prints them harmlessly."""
    code = main(["plan", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("lmc: error: ") and repr(name)[1:-1] in err
    assert not any(ord(char) < 32 for char in err.rstrip("\n"))
