"""`lmc plan SPEC --compare BENCH.json`: the plan's model at each benched level, beside the measured
figures, with the ratio and a flag past 25 %."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmc.measure.compare import compare, predict_level
from lmc.measure.profile import render_profile
from lmc.pipeline import plan_from_spec
from lmc.planner import latency
from lmc.planner.engines import engine_facts
from lmc.schema import load_spec
from tests.test_measure_profile import _calibration

SPEC = """\
[model]
id = "meta-llama/Llama-2-7b-hf"
[target]
instance = "local"
profile = "local.toml"
[workload]
max_input_tokens = 128
max_output_tokens = 64
concurrency = 8
[pin]
engine = "hf"
dtype = "bf16"
tensor_parallel_degree = 1
"""


@pytest.fixture
def planned(tmp_path):
    (tmp_path / "local.toml").write_text(render_profile(_calibration()))
    (tmp_path / "spec.toml").write_text(SPEC)
    result = plan_from_spec(load_spec(tmp_path / "spec.toml"))
    return tmp_path, result


def _report(levels: dict[int, dict[str, float]], plan_sha256: str | None, input_tokens=128, output_tokens=64) -> dict:
    def stats(value):
        return {"p50": value, "p90": value * 1.1, "p99": value * 1.2, "mean": value}

    return {"kind": "lmc-bench", "format_version": 1, "lmc_version": "0.1.0", "target": "x", "plan_sha256": plan_sha256,
            "plan": None, "measured_at": "now", "host": "h", "memory_source": "rss",
            "workload": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            "levels": [{"concurrency": c, "requests": 4, "errors": 0, "first_error": None, "wall_s": 1.0,
                        "ttft_ms": stats(f["ttft_ms"]), "tpot_ms": stats(f["tpot_ms"]), "e2e_ms": stats(f["e2e_ms"]),
                        "output_tokens_per_s": f["output_tokens_per_s"],
                        "peak_worker_memory_bytes": int(f["peak_worker_memory_bytes"])} for c, f in levels.items()],
            "peak_worker_memory_bytes": None, "workers": []}


def test_predictions_per_level_are_the_latency_models(planned):
    _, result = planned
    plan, engine = result.plan, engine_facts()["hf"]
    assert plan.batch_size == 8 and plan.replicas == 1
    one = predict_level(plan, result.model, result.hardware, engine, 1, 100, 50)
    eight = predict_level(plan, result.model, result.hardware, engine, 8, 100, 50)
    assert one["batch"] == 1 and eight["batch"] == 8
    assert one["tpot_ms"] == latency.tpot_ms(result.model, result.hardware, engine, "bf16", 1, 1, 100, 50)
    assert eight["tpot_ms"] == latency.tpot_ms(result.model, result.hardware, engine, "bf16", 1, 8, 100, 50)
    # A lone request waits the batching delay for company; a full batch does not.
    prefill = latency.ttft_ms(result.model, result.hardware, engine, "bf16", 1, 100)
    assert one["ttft_ms"] == pytest.approx(prefill + plan.max_batch_delay_ms)
    assert one["e2e_ms"] == pytest.approx(one["ttft_ms"] + 49 * one["tpot_ms"])
    assert eight["output_tokens_per_s"] == pytest.approx(8 * 50 / eight["e2e_ms"] * 1e3)
    assert eight["peak_worker_memory_bytes"] > one["peak_worker_memory_bytes"]  # the KV cache of 8 rows


@pytest.mark.parametrize(("factor", "flagged"), [(1.0, False), (1.2, False), (0.8, False), (1.3, True), (0.7, True)])
def test_figures_off_by_more_than_25_percent_are_flagged(planned, factor, flagged):
    _, result = planned
    engine = engine_facts()["hf"]
    levels = {c: {k: v * factor for k, v in predict_level(result.plan, result.model, result.hardware, engine, c, 128, 64).items()}
              for c in (1, 8)}
    comparison = compare(result.plan, result.model, result.hardware, engine, _report(levels, result.plan.plan_sha256))
    assert comparison["same_plan"]
    assert len(comparison["rows"]) == 10
    for row in comparison["rows"]:
        assert row["ratio"] == pytest.approx(factor, rel=1e-3)
        assert row["flagged"] is flagged
    assert comparison["flagged"] == (10 if flagged else 0)


def test_cli_prints_predicted_measured_ratio_and_flags(planned):
    tmp_path, result = planned
    engine = engine_facts()["hf"]
    levels = {c: predict_level(result.plan, result.model, result.hardware, engine, c, 128, 64) for c in (1, 8)}
    levels[8] = dict(levels[8], tpot_ms=levels[8]["tpot_ms"] * 1.5)
    (tmp_path / "bench.json").write_text(json.dumps(_report(levels, "0" * 64)))
    cli = [sys.executable, "-m", "lmc", "plan", str(tmp_path / "spec.toml"), "--compare", str(tmp_path / "bench.json")]
    out = subprocess.run(cli, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    tpot_rows = [line.split() for line in out.stdout.splitlines() if "TPOT" in line]
    assert [row[0] for row in tpot_rows] == ["1", "8"]
    assert tpot_rows[0][-1] == "1.00" and tpot_rows[1][-2:] == ["1.50", "OFF"]
    assert "1 of 10 figures off by more than 25%" in out.stdout
    assert "warning: the bench ran plan 000000000000" in out.stdout  # a different plan than the spec's
    as_json = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True).stdout)
    assert as_json["flagged"] == 1 and not as_json["same_plan"]


@pytest.mark.parametrize(("content", "message"), [
    (None, "No such file"),
    ("{not json", "not a bench report"),
    ('{"kind": "something else"}', "not a bench report (`lmc bench --json` writes one)"),
    ('{"kind": "lmc-bench", "format_version": 99, "levels": [], "workload": {}}', "bench report format 99"),
])
def test_a_file_that_is_not_a_bench_report_is_one_line_exit_1(planned, content, message):
    tmp_path, _ = planned
    bench = tmp_path / "bench.json"
    if content is not None:
        bench.write_text(content)
    out = subprocess.run([sys.executable, "-m", "lmc", "plan", str(tmp_path / "spec.toml"), "--compare", str(bench)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert message in out.stderr and out.stderr.count("\n") == 1


def test_a_vllm_plan_is_compared_through_its_own_serving_model():
    from lmc.measure.compare import compare, render_comparison
    from lmc.planner import catalog, plan_deployment
    from lmc.planner.engines import engine_facts
    from lmc.planner.vllm import vllm_memory, vllm_predict
    from lmc.schema.spec import Spec

    model, hardware, vllm = catalog.model_facts("Qwen/Qwen3-8B"), catalog.hardware_facts("ml.g6e.xlarge"), engine_facts()["vllm"]
    spec = Spec.model_validate({"model": {"id": model.id}, "target": {"instance": "ml.g6e.xlarge"},
                                "pin": {"engine": "vllm", "dtype": "bf16"}, "workload": {"concurrency": 8}})
    plan = plan_deployment(spec, model, hardware, spec_sha256="0" * 64, lmc_version="test")
    figures = {"ttft_ms": 100.0, "tpot_ms": 20.0, "e2e_ms": 1300.0, "output_tokens_per_s": 300.0,
               "peak_worker_memory_bytes": 2**34}
    result = compare(plan, model, hardware, vllm, _report({1: figures, 8: figures}, plan.plan_sha256, 512, 128))
    _, layout = vllm_memory(model, hardware, vllm, vllm.efficiency["gpu"], "bf16", 1, plan.vllm.max_num_seqs,
                            spec.workload.max_input_tokens, spec.workload.max_output_tokens, 0.9, None)
    want = vllm_predict(model, hardware, vllm, "bf16", 1, plan.replicas, layout, 512, 128, 8)
    row = next(r for r in result["rows"] if r["concurrency"] == 8 and r["figure"] == "tpot_ms")
    assert row["predicted"] == pytest.approx(want.tpot_ms)
    assert "step times: aiconfigurator-core 0.12.0 measured data (l40s, vllm 0.24.0)" in render_comparison(
        result, "spec.toml", "bench.json")
