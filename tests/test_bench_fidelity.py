"""bench/fidelity.py: its CSV of published measurements is well-formed and cited, and its arithmetic is right."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from lmc.planner import catalog
from lmc.schema import parse_spec

REPO = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location("fidelity_bench", REPO / "bench" / "fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fidelity = _load_bench()
ROWS = fidelity.load_rows(fidelity.DEFAULT_CSV)


def test_csv_has_enough_rows_with_unique_ids():
    ids = [row["id"] for row in ROWS]
    assert len(ROWS) >= 60
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("row", ROWS, ids=[row["id"] for row in ROWS])
def test_row_is_cited_and_well_formed(row):
    assert re.fullmatch(r"https://\S+", row["source_url"]), row["source_url"]
    assert row["source_table"].strip(), "which table or figure of the source"
    assert re.fullmatch(r"\d{4}-\d{2}(-\d{2})?", row["source_date"]), row["source_date"]
    lowered = (row["source_url"] + " " + row["source_table"] + " " + row["notes"]).lower()
    assert not [name for name in fidelity.FORBIDDEN_SOURCES if name in lowered]
    assert row["gpu"] in fidelity.GPU_INSTANCE and row["engine"] in fidelity.ENGINE_AIC_BACKEND
    assert row["num_gpus"] == row["tp"] * row["dp"]
    assert row["concurrency"] is not None and 1 <= row["concurrency"] <= 256
    assert row["input_len"] > 0 and row["output_len"] > 0
    measured = [row[key] for key in fidelity.MEASURED if row[key] is not None]
    assert measured and all(value > 0 for value in measured)
    assert row["weight_dtype"] in {"bf16", "fp16", "fp8", "mxfp4"} and row["kv_dtype"] in {"bf16", "fp16", "fp8"}


@pytest.mark.parametrize("row", ROWS, ids=[row["id"] for row in ROWS])
def test_row_spec_is_a_valid_lmc_spec_of_a_catalog_model(row):
    assert catalog.has_model(row["model"])
    loaded = parse_spec(fidelity.spec_text(row), REPO / "bench" / "data" / "row.toml")
    assert loaded.spec.pin.engine == "vllm"
    assert loaded.spec.pin.tensor_parallel_degree == row["tp"]
    assert loaded.spec.workload.concurrency == row["concurrency"]
    assert loaded.spec.workload.max_input_tokens == row["input_len"]


def test_forbidden_sources_are_recognised():
    for url in ("https://inferencemax.semianalysis.com/", "https://github.com/SemiAnalysisAI/InferenceX/issues/1",
                "https://docs.gpustack.ai/latest/performance-lab/x", "https://docs.nvidia.com/nim/benchmarking/llm/"):
        assert [name for name in fidelity.FORBIDDEN_SOURCES if name in url.lower()], url


def test_errors_and_medians_on_two_hand_made_rows():
    def row(row_id, **measured):
        return {"id": row_id, "tpot_ms": None, "ttft_ms": None, "output_throughput_tok_s": None, **measured}

    first = fidelity.RowResult(row("hand-a-1", tpot_ms=20.0, ttft_ms=100.0, output_throughput_tok_s=1000.0),
                               lmc={"tpot_ms": 25.0, "ttft_ms": 50.0, "output_throughput_tok_s": 900.0})
    second = fidelity.RowResult(row("hand-b-1", tpot_ms=40.0, output_throughput_tok_s=500.0),
                                lmc={"tpot_ms": 30.0, "ttft_ms": 70.0, "output_throughput_tok_s": 800.0},
                                aic={"error": "OOM"})
    assert first.errors("lmc") == {"tpot_ms": 25.0, "ttft_ms": -50.0, "output_throughput_tok_s": -10.0}
    assert second.errors("lmc") == {"tpot_ms": -25.0, "ttft_ms": None, "output_throughput_tok_s": 60.0}
    stats = fidelity.summary([first, second], with_aic=True)
    assert stats["lmc_tpot_ms"] == {"median_abs_pct": 25.0, "worst_abs_pct": 25.0, "n": 2}
    assert stats["lmc_ttft_ms"] == {"median_abs_pct": 50.0, "worst_abs_pct": 50.0, "n": 1}
    assert stats["lmc_output_throughput_tok_s"] == {"median_abs_pct": 35.0, "worst_abs_pct": 60.0, "n": 2}
    assert stats["aiconfigurator_answered"] == 0 and stats["lmc_planned"] == 2
    assert stats["groups"]["hand-a"]["lmc_tpot_ms"] == {"median_abs_pct": 25.0, "worst_abs_pct": 25.0, "n": 1}
    assert stats["groups"]["hand-b"]["lmc_output_throughput_tok_s"]["median_abs_pct"] == 60.0
    # Like with like: only rows where both give the figure; aiconfigurator refused the second, answered the first.
    third = fidelity.RowResult(row("hand-c-1", tpot_ms=10.0), lmc={"tpot_ms": 13.0, "ttft_ms": None,
                                                                   "output_throughput_tok_s": None},
                               aic={"tpot_ms": 11.0, "ttft_ms": None, "output_throughput_tok_s": None})
    both = fidelity.summary([first, second, third], with_aic=True)["groups"]["both answer"]
    assert both["lmc_tpot_ms"] == {"median_abs_pct": 30.0, "worst_abs_pct": 30.0, "n": 1}
    assert both["aiconfigurator_tpot_ms"]["n"] == 1 and both["lmc_ttft_ms"]["n"] == 0


def test_aiconfigurator_report_is_parsed_and_refusals_kept():
    report = ("  TTFT:             346.584 ms\n  TPOT:             24.500 ms\n  Request Latency:  19922.146 ms\n"
              "  tokens/s:         641.70\n  tokens/s/gpu:     80.21\n")
    assert fidelity.parse_aic_output(report) == {"ttft_ms": 346.584, "tpot_ms": 24.5, "output_throughput_tok_s": 641.7}
    assert fidelity.parse_aic_output(report.replace("641.70", "1,641.70").replace("346.584", "6,120.5"))[
        "output_throughput_tok_s"] == 1641.7
    assert fidelity.parse_aic_output(report.replace("346.584", "6,120.5"))["ttft_ms"] == 6120.5
    assert fidelity.parse_aic_output("[E] ... estimate failed: OOM at batch 256") == {"error": "OOM"}


def test_aiconfigurator_command_follows_the_row():
    trtllm = next(row for row in ROWS if row["engine"] == "trtllm" and row["ep"] == 4)
    args = fidelity.aic_args(trtllm, bundled={"deepseek-ai/deepseek-r1": "deepseek-ai/DeepSeek-R1"})
    flags = dict(zip(args[2::2], args[3::2]))
    assert args[:2] == ["cli", "estimate"]
    assert flags["--model-path"] == "deepseek-ai/DeepSeek-R1" and flags["--system"] == "h200_sxm"
    assert flags["--backend"] == "trtllm" and flags["--tp-size"] == "8"
    assert (flags["--moe-tp-size"], flags["--moe-ep-size"]) == ("2", "4")  # 8 ranks: EP 4 x TP 2
    assert flags["--batch-size"] == str(trtllm["concurrency"]) and flags["--kvcache-quant-mode"] == "bfloat16"
    # attention DP (SGLang's --enable-dp-attention: MoE TP 8 under 8 DP groups): its batch size is per group
    dp_row = next(row for row in ROWS if row["engine"] == "sglang" and row["dp"] == 8 and row["concurrency"] == 64)
    flags = dict(zip(*[iter(fidelity.aic_args(dp_row, bundled={})[2:])] * 2))
    assert (flags["--tp-size"], flags["--attention-dp-size"], flags["--batch-size"]) == ("1", "8", "8")
    assert (flags["--moe-tp-size"], flags["--moe-ep-size"]) == ("8", "1")
    dense_fp8 = next(row for row in ROWS if row["model"] == "meta-llama/Llama-3.1-405B")
    flags = dict(zip(*[iter(fidelity.aic_args(dense_fp8, bundled={})[2:])] * 2))
    assert "--moe-tp-size" not in flags and flags["--gemm-quant-mode"] == "fp8"  # bf16 checkpoint served in fp8
    assert flags["--model-path"] == "meta-llama/Meta-Llama-3.1-405B"  # the name aiconfigurator bundles it under
    qwen = {**dense_fp8, "model": "Qwen/Qwen2.5-7B-Instruct", "weight_dtype": "bf16"}
    flags = dict(zip(*[iter(fidelity.aic_args(qwen, bundled={})[2:])] * 2))
    assert flags["--model-path"].endswith("qwen--qwen2.5-7b-instruct") and "--gemm-quant-mode" not in flags
    # the cache keys a catalog path from the checkout's root: the same in every checkout
    shown = fidelity.portable_args(fidelity.aic_args(qwen, bundled={}))
    assert shown[shown.index("--model-path") + 1] == "lmc/planner/data/models/qwen--qwen2.5-7b-instruct"
    assert shown[shown.index("--system") + 1] == flags["--system"]


def test_markdown_table_has_a_row_per_result_and_the_summary():
    result = fidelity.RowResult({**ROWS[0]}, lmc={"tpot_ms": 50.0, "ttft_ms": 100.0, "output_throughput_tok_s": 200.0,
                                                  "predictor": "lmc-roofline"})
    stats = fidelity.summary([result], with_aic=False)
    text = fidelity.markdown_table([result], stats, with_aic=False)
    assert f"| {ROWS[0]['id']} |" in text and "lmc-roofline" in text
    assert "| lmc, all rows | " in text and "1 of 1" in text


def test_predictor_is_the_name_the_plan_gives():
    named = {"predicted": {"tpot_ms": 16.3, "step_times": "aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0)"}}
    assert fidelity.find_predictor(named) == "aiconfigurator-core 0.12.0 measured data (h100_sxm, vllm 0.24.0)"
    assert fidelity.find_predictor({"predicted": {"tpot_ms": 16.3}, "predictor": "lmc roofline"}) == "lmc roofline"
    assert fidelity.find_predictor({"predicted": {"tpot_ms": 16.3}}) is None  # the bench then says lmc-roofline


def test_kv_cache_dtype_follows_the_row_where_the_spec_has_the_field():
    allowed = {"auto", "fp8"}  # the shape of a `kv_cache_dtype: Literal["auto", "fp8"]` pin
    assert fidelity.kv_dtype_value("fp8", allowed) == "fp8"
    assert fidelity.kv_dtype_value("bf16", allowed) == "auto"  # the measured run's 16-bit cache, not lmc's choice
    assert fidelity.kv_dtype_value("fp8", set()) is None and fidelity.kv_dtype_value("bf16", {"fp8"}) is None


@pytest.mark.parametrize("gpu", sorted(fidelity.GPU_INSTANCE))
def test_each_gpu_maps_to_a_catalog_instance_of_that_gpu(gpu):
    facts = catalog.hardware_facts(fidelity.GPU_INSTANCE[gpu])
    assert facts.accelerator.startswith(gpu) and facts.devices == 8  # room for any TP x DP of a row
    assert gpu in fidelity.GPU_AIC_SYSTEM


def test_the_number_of_prompts_comes_from_the_column_or_the_rows_notes():
    row = {"concurrency": 16, "notes": "client: ... --num-prompts 80 --max-concurrency 16"}
    assert fidelity.row_prompts(row) == 80
    assert fidelity.row_prompts({"concurrency": 10, "notes": "--max-concurrency 10 --num-prompt 100"}) == 100
    assert fidelity.row_prompts({**row, "num_prompts": "320"}) == 320
    assert fidelity.row_prompts({"concurrency": 4, "notes": "500 prompts, random-range-ratio 1"}) == 500
    assert fidelity.row_prompts({"concurrency": 8, "notes": "150 requests at concurrency 8"}) == 150
    assert fidelity.row_prompts({"concurrency": 4, "notes": "offline: the whole batch submitted at once"}) == 4
    assert fidelity.row_prompts({"concurrency": 1, "notes": "bench_one_batch_server --batch-size 1"}) is None


def test_a_row_with_its_prompts_is_compared_with_the_run_its_client_measured():
    rows = {row["id"]: row for row in fidelity.load_rows(fidelity.DEFAULT_CSV)}
    row = next(r for r in rows.values() if r["statistic"].startswith("mean") and fidelity.row_prompts(r)
               and r["concurrency"] > 1 and r["tpot_ms"])
    figures = fidelity.lmc_predict(row)
    assert figures["prompts"] == fidelity.row_prompts(row)
    run_free = fidelity.lmc_predict({**row, "notes": "", "num_prompts": ""})
    assert "prompts" not in run_free
    # The burst at the start of the run: its first requests wait for each other's prompts.
    assert figures["ttft_ms"] > run_free["ttft_ms"]


def test_since_summarises_the_recent_rows_besides_all_rows():
    def result(row_id, date, tpot, engine="vllm"):
        row = {"id": row_id, "source_date": date, "engine": engine, "tpot_ms": 10.0, "ttft_ms": None,
               "output_throughput_tok_s": None}
        return fidelity.RowResult(row, lmc={"tpot_ms": tpot, "ttft_ms": None, "output_throughput_tok_s": None})

    results = [result("old-1", "2024-12-05", 20.0), result("new-1", "2026-01-18", 11.0),
               result("new-2", "2026-02-17", 13.0, engine="trtllm")]
    stats = fidelity.summary(results, with_aic=False, since="2025-08-01")
    assert stats["lmc_tpot_ms"]["median_abs_pct"] == 30.0  # of 100, 10 and 30 %
    assert stats["groups"]["since 2025-08-01"]["lmc_tpot_ms"] == {"median_abs_pct": 20.0, "worst_abs_pct": 30.0, "n": 2}
    # the recent rows measured on vLLM, the engine every row is planned as
    assert stats["groups"]["since 2025-08-01, vllm rows"]["lmc_tpot_ms"] == {"median_abs_pct": 10.0,
                                                                             "worst_abs_pct": 10.0, "n": 1}


def test_a_rows_data_parallel_degree_is_pinned_even_when_it_is_one():
    row = next(r for r in ROWS if r["dp"] == 1 and r["num_gpus"] == r["tp"])
    spec = parse_spec(fidelity.spec_text(row), REPO / "bench" / "data" / "x.toml").spec
    assert spec.pin.data_parallel_degree == 1  # else lmc may add DP groups of an MoE model on the instance's other GPUs


CACHED = [row for row in ROWS if row.get("cached_prompts")]


@pytest.mark.parametrize("row", CACHED, ids=[row["id"] for row in CACHED])
def test_cached_prompts_are_the_earlier_runs_prompts_the_seeded_client_rebuilt(row):
    """A row's `cached_prompts` is what its notes derive: SGLang's bench_serving builds prompt i from its seed alone
    (numpy draws the lengths, in order), so a run repeats the first prompts of the page's run before it with the
    same server and nominal lengths (else only its warm-up, prompt 0). Checked against the published totals: the
    seeded draw must reproduce this run's input tokens exactly, or the derivation does not hold for it."""
    numpy = pytest.importorskip("numpy")
    nominal = int(re.search(r"--random-input-len (\d+)", row["notes"]).group(1))
    total, prompts = map(int, re.search(r"published totals / requests \((\d+)/(\d+),", row["notes"]).groups())
    assert prompts == fidelity.row_prompts(row)
    lengths = numpy.random.RandomState(1).randint(1, nominal + 1, size=prompts)  # --seed 1, range ratio 0
    assert int(lengths.sum()) == total
    earlier = [other for other in ROWS if other["source_url"] == row["source_url"] and other["id"] < row["id"]
               and f"--random-input-len {nominal} " in other["notes"]]
    assert int(row["cached_prompts"]) == (fidelity.row_prompts(earlier[-1]) if earlier else 1)


TRT_PERF_SANITY = [row for row in ROWS if "perf-sanity lane for these recipes" in row["notes"]]


@pytest.mark.parametrize("row", TRT_PERF_SANITY, ids=[row["id"] for row in TRT_PERF_SANITY])
def test_a_tensorrt_llm_recipe_row_runs_its_perf_sanity_clients_prompts(row):
    """The GLM-4.7 PR states no client. Its rows take TensorRT-LLM's perf-sanity lane for the same recipes:
    concurrency x iterations (10) prompts at fixed lengths with no warm-up request, and so the run they are
    compared with is that many prompts, not the plan's steady state."""
    assert row["engine"] == "trtllm" and row["concurrency"] > 0
    assert f"--max-concurrency {row['concurrency']} " in row["notes"]
    assert fidelity.row_prompts(row) == 10 * row["concurrency"]
    assert not row["output_len_min"] and not row["output_len_max"]  # range ratio 0: fixed lengths
    assert "prompts" in fidelity.lmc_predict(row)


def test_the_glm_rows_all_carry_the_perf_sanity_client():
    glm = [row for row in ROWS if row["id"].startswith("trtglm47h100-")]
    assert len(glm) == 13 and all(row in TRT_PERF_SANITY for row in glm)
