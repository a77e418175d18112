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


def test_predictions_per_level_match_figures_worked_out_by_hand(planned):
    """Llama-2-7B, bf16, TP 1, on the measured CPU profile (test_measure_profile._calibration: hf decodes
    bf16 at 24e9 B/s and 0.4 TFLOPS a row, prefills at 0.6 TFLOPS; 0.25 ms a step, 0.11 ms a layer, 3.0 ms a
    prefill), 100 prompt and 50 output tokens, worked out by hand from the latency model's formulas
    (docs/planner.md), not by calling them:

    split: embedding = LM head = 32000 · 4096 = 131,072,000; norms = 32 · 4 · 4096 + 4096 = 528,384;
      matrices = 6,738,415,616 − 2 · 131,072,000 − 528,384 = 6,475,743,232
    decode, per step: weights read = (matrices + LM head) · 2 B = 13,213,630,464 B; KV per row at the
      mean context 100 + 50/2 = 125: 2 · 32 layers · 32 heads · 128 · 2 B · 125 = 65,536,000 B;
      FLOPs per row = 2 · 6,606,815,232 + 4 · 125 · 32 · 128 · 32 = 13,279,166,464; fixed 0.25 + 32 · 0.11 = 3.77
      TPOT(1) = (13,213,630,464 + 65,536,000) / 24e9 s + 13,279,166,464 / 0.4e12 s + 3.77 ms
              = 553.29860 + 33.19792 + 3.77 = 590.26652 ms
      TPOT(8) = (13,213,630,464 + 8 · 65,536,000) / 24e9 + 8 · 13,279,166,464 / 0.4e12 + 3.77
              = 572.41327 + 265.58333 + 3.77 = 841.76660 ms
    prefill of n tokens: FLOPs = 2 · 6,606,815,232 · n + 4 · n² · 32 · 128 · 32 (eager CPU attention computes
      the whole score matrix), at 0.6 TFLOPS; all 6,738,415,616 · 2 B of weights read once at 24e9 B/s
      (561.53463 ms); fixed 3.77 + 3.0
      TTFT(1) = prefill(100) + the 10 ms batching delay (a lone request waits for company)
              = 1,326,605,926,400 / 0.6e12 s + 561.53463 + 6.77 + 10 = 2211.00988 + 578.30463 = 2789.31451 ms
      TTFT(8) = prefill(800), a full batch waits no delay
              = 10,906,448,691,200 / 0.6e12 s + 568.30463 = 18177.41449 + 568.30463 = 18745.71912 ms
    E2E = TTFT + 49 · TPOT; output tokens/s = rows · 50 / E2E."""
    _, result = planned
    plan, engine, model = result.plan, engine_facts()["hf"], result.model
    # The inputs the arithmetic above takes.
    assert (plan.batch_size, plan.replicas, plan.max_batch_delay_ms, plan.dtype, plan.tensor_parallel_degree) == \
        (8, 1, 10, "bf16", 1)
    assert (model.parameters, model.layers, model.hidden_size, model.attention_heads, model.kv_heads, model.head_dim,
            model.vocab_size, model.tie_word_embeddings) == (6_738_415_616, 32, 4096, 32, 32, 128, 32000, False)
    one = predict_level(plan, model, result.hardware, engine, 1, 100, 50)
    eight = predict_level(plan, model, result.hardware, engine, 8, 100, 50)
    assert (one["batch"], eight["batch"]) == (1, 8)
    assert one["tpot_ms"] == pytest.approx(590.26652, abs=1e-5)
    assert eight["tpot_ms"] == pytest.approx(841.76660, abs=1e-5)
    assert one["ttft_ms"] == pytest.approx(2789.31451, abs=1e-5)
    assert eight["ttft_ms"] == pytest.approx(18745.71912, abs=1e-5)
    assert one["e2e_ms"] == pytest.approx(2789.31451 + 49 * 590.26652, abs=1e-3)
    assert eight["output_tokens_per_s"] == pytest.approx(8 * 50 / (18745.71912 + 49 * 841.76660) * 1e3, rel=1e-7)
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


@pytest.mark.parametrize(("path", "value", "message"), [
    (("levels", 0, "tpot_ms", "p50"), "x", "levels[0].tpot_ms.p50 must be a finite number of at least 0, not 'x'"),
    (("levels", 0, "output_tokens_per_s"), float("inf"), "levels[0].output_tokens_per_s must be a finite number"),
    (("levels", 1, "e2e_ms"), [], "levels[1].e2e_ms must be a finite number of at least 0, not []"),
    (("levels", 0, "concurrency"), 0, "levels[0].concurrency must be a whole number from 1 to 1000000, not 0"),
    (("levels", 0), 5, "levels[0] must be an object, not 5"),
    (("workload", "input_tokens"), None, "workload.input_tokens must be a positive integer, not None"),
    (("plan_sha256",), 12, "plan_sha256 must be a string, not 12"),
])
def test_a_report_with_unusable_figures_is_one_line_exit_1(planned, path, value, message):
    """Each of these crashed --compare (exit 70: dividing a string, predicting for concurrency 0) or, for an
    infinite or NaN figure, printed it as a measurement; found by fuzzing a bench report's fields."""
    tmp_path, _ = planned
    report = _report({1: dict(ttft_ms=100, tpot_ms=20, e2e_ms=1400, output_tokens_per_s=50, peak_worker_memory_bytes=1e9),
                      8: dict(ttft_ms=300, tpot_ms=30, e2e_ms=2200, output_tokens_per_s=250,
                              peak_worker_memory_bytes=1.2e9)}, None)
    target = report
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(report))
    out = subprocess.run([sys.executable, "-m", "lmc", "plan", str(tmp_path / "spec.toml"), "--compare", str(bench)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert f"--compare {bench}: not a bench report lmc wrote: {message}" in out.stderr and out.stderr.count("\n") == 1


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
