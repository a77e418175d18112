"""Fidelity bench: lmc's predicted TPOT, TTFT and throughput against published serving measurements.

Reads bench/data/fidelity.csv (published measurements of vLLM, SGLang and TensorRT-LLM serving today's
models on H100/H200/A100, each row cited: source URL, table, date), plans every row with lmc in-process
as its `vllm` engine on the row's GPUs, TP/DP/EP, dtype, lengths and concurrency, and prints per row the
measured figures beside lmc's, with signed % errors and the predictor lmc names, and beside them
aiconfigurator's CLI estimate of the same row when `--aiconfigurator` points at its executable (run from
its own virtualenv; results cached in bench/data/aiconfigurator.json with the version). Then the median
and worst absolute % errors and the rows planned/answered. Exit 1 when any row fails to plan.

Usage:
    python bench/fidelity.py [--csv CSV] [--aiconfigurator /work/aic-venv/bin/aiconfigurator] [--json OUT]
                             [--markdown OUT] [--since 2025-08-01]
    PYTHONPATH=/work/wt/h31model python bench/fidelity.py      # another lmc: imported from sys.path
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CSV = HERE / "data" / "fidelity.csv"
DEFAULT_AIC_CACHE = HERE / "data" / "aiconfigurator.json"

NUMERIC = ("num_gpus", "tp", "dp", "ep", "input_len", "output_len", "concurrency", "request_rate",
           "tpot_ms", "ttft_ms", "output_throughput_tok_s")
MEASURED = ("tpot_ms", "ttft_ms", "output_throughput_tok_s")
# Held back to check the planner independently (DESIGN.md, issue 31): never rows of this bench.
FORBIDDEN_SOURCES = ("inferencemax", "inferencex", "semianalysis", "gpustack", "docs.nvidia.com/nim",
                     "build.nvidia.com", "nim/benchmarking")

# The row's GPU -> the catalog instance with those GPUs (NVLink/NVSwitch among them), and aiconfigurator's system.
GPU_INSTANCE = {"h100": "ml.p5.48xlarge", "h200": "ml.p5e.48xlarge", "a100-80gb": "ml.p4de.24xlarge",
                "a100-40gb": "ml.p4d.24xlarge", "l40s": "ml.g6e.48xlarge", "l4": "ml.g6.48xlarge"}
GPU_AIC_SYSTEM = {"h100": "h100_sxm", "h200": "h200_sxm", "a100-80gb": "a100_sxm", "a100-40gb": "a100_sxm",
                  "l40s": "l40s", "l4": "l4"}
ENGINE_AIC_BACKEND = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}
# Models aiconfigurator 0.12 bundles under another name with the same config (architecture and sizes).
AIC_MODEL_ALIAS = {
    "meta-llama/llama-3.3-70b-instruct": "meta-llama/Meta-Llama-3.1-70B",
    "meta-llama/llama-3.1-70b-instruct": "meta-llama/Meta-Llama-3.1-70B",
    "meta-llama/llama-3.1-8b-instruct": "meta-llama/Meta-Llama-3.1-8B",
    "meta-llama/llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B",
    "meta-llama/llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B",
    "meta-llama/llama-3.1-405b": "meta-llama/Meta-Llama-3.1-405B",
    "deepseek-ai/deepseek-r1-0528": "deepseek-ai/DeepSeek-R1",
}
LMC_DTYPES = {"bf16", "fp16", "fp8"}  # weight dtypes lmc pins; others (mxfp4) are the checkpoint's own


# --- the rows ---------------------------------------------------------------------------------------

def load_rows(path: Path) -> list[dict]:
    """The CSV's rows, numbers parsed (blank -> None)."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for key in NUMERIC:
            text = (row.get(key) or "").strip()
            row[key] = None if text == "" else float(text)
        for key in ("num_gpus", "tp", "dp", "ep", "input_len", "output_len", "concurrency"):
            if row[key] is not None:
                row[key] = int(row[key])
        row["dp"] = row["dp"] or 1
        row["ep"] = row["ep"] or 1
    return rows


# --- lmc -------------------------------------------------------------------------------------------

def _kv_dtype_field() -> tuple[str, str, set[str]] | None:
    """The spec section and key for the KV-cache dtype, and the values it takes, where this lmc's spec has one."""
    from lmc.schema import Spec

    for section, info in Spec.model_fields.items():
        fields = _model_fields(info.annotation)
        for name, field_info in fields.items():
            if "kv" in name and "dtype" in name:
                return section, name, set(_literal_values(field_info.annotation))
    return None


def _model_fields(annotation) -> dict:
    fields = getattr(annotation, "model_fields", None)
    if fields:
        return fields
    for arg in getattr(annotation, "__args__", ()):  # Optional[Section]
        fields = getattr(arg, "model_fields", None)
        if fields:
            return fields
    return {}


def _literal_values(annotation) -> list[str]:
    """The strings a Literal[...] (or Optional[Literal[...]]) annotation allows."""
    values = []
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, str):
            values.append(arg)
        else:
            values += _literal_values(arg)
    return values


def kv_dtype_value(row_kv: str, allowed: set[str]) -> str | None:
    """The spec's value for the row's KV-cache dtype: fp8 as fp8, a 16-bit cache as the compute dtype ("auto",
    vLLM's default), None where the spec cannot say it."""
    if row_kv == "fp8" and "fp8" in allowed:
        return "fp8"
    if row_kv in ("bf16", "fp16"):
        for value in ("auto", row_kv):
            if value in allowed:
                return value
    return None


def spec_text(row: dict) -> str:
    """The lmc spec (TOML) for a row: vllm pinned on the row's GPUs, layout, dtype, lengths, concurrency."""
    tables: dict[str, dict] = {
        "model": {"id": row["model"]},
        "target": {"instance": GPU_INSTANCE[row["gpu"]]},
        "workload": {"max_input_tokens": row["input_len"], "max_output_tokens": row["output_len"],
                     "concurrency": row["concurrency"] or 1},
        "pin": {"engine": "vllm", "tensor_parallel_degree": row["tp"], "replicas": 1},
    }
    # Always pinned, 1 included: unpinned, lmc may add data-parallel groups of an MoE model on the instance's
    # other GPUs, which the measured run did not have.
    tables["pin"]["data_parallel_degree"] = row["dp"]
    if row["ep"] > 1:
        tables["pin"]["expert_parallel"] = True
    if row["weight_dtype"] in LMC_DTYPES:
        tables["pin"]["dtype"] = row["weight_dtype"]
    kv_field = _kv_dtype_field()
    if kv_field is not None:
        section, key, allowed = kv_field
        value = kv_dtype_value(row["kv_dtype"], allowed)
        if value is not None:
            tables.setdefault(section, {})[key] = value
    lines = []
    for name, values in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def find_predictor(plan: dict) -> str | None:
    """The name of the model that produced the plan's figures, where the plan JSON gives one
    (`predicted.step_times`, `predicted.predictor` or a top-level `*predictor*` key)."""
    predicted = plan.get("predicted") or {}
    for key in ("predictor", "step_times", "step_model", "model", "source"):
        if isinstance(predicted.get(key), str):
            return predicted[key]
    for key, value in predicted.items():
        if ("predictor" in key or "step" in key) and isinstance(value, str):
            return value
    for key, value in plan.items():
        if "predictor" in key and isinstance(value, str):
            return value
        if "predictor" in key and isinstance(value, dict):
            for inner in ("name", "step_times", "source"):
                if isinstance(value.get(inner), str):
                    return value[inner]
    return None


def row_prompts(row: dict) -> int | None:
    """The number of requests the row's benchmark run sent: the CSV's `num_prompts` where it has the column, else
    what its notes say (`--num-prompts N`, "N prompts", "N requests at concurrency"; an offline run that submits
    the whole batch at once sent `concurrency`); None where the run is not a closed-loop serving run."""
    if row.get("num_prompts"):
        return int(float(row["num_prompts"]))
    notes = row.get("notes") or ""
    match = (re.search(r"--num-prompts?\s+(\d+)", notes) or re.search(r"\b(\d+) prompts\b", notes)
             or re.search(r"\b(\d+) requests at concurrency\b", notes))
    if match:
        return int(match.group(1))
    if "whole batch submitted at once" in notes:
        return row["concurrency"]
    return None


def lmc_predict(row: dict) -> dict:
    """lmc's TPOT, TTFT and throughput for the row, from its pipeline in-process: the figures the row's benchmark
    run reports (lmc.planner.benchmark_run: N prompts, the first `concurrency` sent together; means or medians as
    the row's `statistic` says) where the row gives its number of prompts and this lmc has that model, else the
    plan's steady-state figures."""
    from lmc.pipeline import plan_from_spec
    from lmc.schema import parse_spec

    loaded = parse_spec(spec_text(row), HERE / "data" / f"fidelity-{row['id']}.toml")
    result = plan_from_spec(loaded)
    plan = result.plan.model_dump(mode="json")
    predicted = plan["predicted"]
    figures = {"tpot_ms": predicted.get("tpot_ms"), "ttft_ms": predicted.get("ttft_ms"),
               "output_throughput_tok_s": predicted.get("throughput_tokens_per_s"),
               "predictor": find_predictor(plan) or "lmc-roofline"}
    prompts = row_prompts(row)
    if prompts is None and "ITL" in (row.get("statistic") or ""):
        prompts = row["concurrency"] or 1  # an ITL without its run's size: the gaps of one wave's requests
    run = benchmark_run(result, row, prompts) if prompts else None
    if run is not None:
        statistic = row.get("statistic") or "mean"
        median = statistic.startswith("median")
        figures.update(ttft_ms=run.median_ttft_ms if median else run.mean_ttft_ms,
                       tpot_ms=(run.median_itl_ms if "ITL" in statistic else run.median_tpot_ms) if median
                       else run.mean_tpot_ms,
                       output_throughput_tok_s=run.throughput_tokens_per_s, prompts=prompts)
    return figures


def benchmark_run(result, row: dict, prompts: int):
    """The plan's serving model over the row's finite run, or None where this lmc has no such model."""
    try:
        from lmc.planner.benchmark_run import vllm_benchmark_run
        from lmc.planner.engines import engine_facts
        from lmc.planner.vllm import plan_layout
    except ImportError:  # an lmc from before the benchmark-run model
        return None
    plan = result.plan
    if plan.vllm is None:
        return None
    cached = int(float(row.get("cached_prompts") or 0))  # an earlier run on the same server sent them (the notes)
    spread = (int(float(row["output_len_min"])), int(float(row["output_len_max"]))) \
        if row.get("output_len_min") and row.get("output_len_max") else None  # lengths drawn from a range
    return vllm_benchmark_run(result.model, result.hardware, engine_facts()[plan.engine], plan.dtype,
                              plan.tensor_parallel_degree, plan.replicas, plan_layout(plan, result.model,
                                                                                      result.hardware),
                              row["input_len"], row["output_len"], row["concurrency"] or 1, prompts, cached=cached,
                              output_range=spread)


# --- aiconfigurator ---------------------------------------------------------------------------------

def aic_model_path(model: str, bundled: dict[str, str]) -> str:
    """The id aiconfigurator's CLI knows for the row's model: its bundled name (`bundled`: lower-cased id -> id),
    the bundled name of the same architecture, or lmc's catalog config dir."""
    alias = AIC_MODEL_ALIAS.get(model.lower())
    if alias:
        return alias
    if model.lower() in bundled:
        return bundled[model.lower()]
    from lmc.planner import catalog

    directory = catalog.MODELS_DIR / model.lower().replace("/", "--")
    return str(directory) if (directory / "config.json").is_file() else model


def aic_args(row: dict, bundled: dict[str, str]) -> list[str]:
    """aiconfigurator's `cli estimate` arguments for the row (agg serving at the row's concurrency; with attention
    DP, the concurrency over the groups, rounded up: its base_backend counts `bs x attention_dp_size` requests)."""
    args = ["cli", "estimate", "--model-path", aic_model_path(row["model"], bundled),
            "--system", GPU_AIC_SYSTEM[row["gpu"]], "--backend", ENGINE_AIC_BACKEND[row["engine"]],
            "--isl", str(row["input_len"]), "--osl", str(row["output_len"]),
            "--batch-size", str(-(-(row["concurrency"] or 1) // row["dp"])), "--tp-size", str(row["tp"])]
    if row["dp"] > 1:  # its batch size is per attention-DP group (global_bs = bs x attention_dp_size)
        args += ["--attention-dp-size", str(row["dp"])]
    if _is_moe(row["model"]):
        ranks = row["tp"] * row["dp"]
        ep = min(row["ep"], ranks)
        args += ["--moe-tp-size", str(ranks // ep), "--moe-ep-size", str(ep)]
    args += ["--kvcache-quant-mode", "fp8" if row["kv_dtype"] == "fp8" else "bfloat16"]
    if row["weight_dtype"] == "fp8" and not _checkpoint_quantized(row["model"]):
        args += ["--gemm-quant-mode", "fp8"]
    return args


def _is_moe(model: str) -> bool:
    from lmc.planner import catalog

    return catalog.model_facts(model).num_experts > 1


def _checkpoint_quantized(model: str) -> bool:
    from lmc.planner import catalog

    return catalog.model_facts(model).checkpoint_quantization is not None


def parse_aic_output(text: str) -> dict:
    """TTFT, TPOT and output tokens/s from `aiconfigurator cli estimate`'s report; its refusal otherwise."""
    figures = {}
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("output_throughput_tok_s", "tokens/s")):
        match = re.search(rf"^\s*{re.escape(label)}:\s+([0-9][0-9,]*(?:\.[0-9]+)?)", text, re.MULTILINE)
        if match:  # figures past 999 come with thousands separators: "tokens/s: 1,234.56"
            figures[key] = float(match.group(1).replace(",", ""))
    if len(figures) == 3:
        return figures
    if re.search(r"\bOOM\b|out of memory", text, re.IGNORECASE):
        return {"error": "OOM"}
    errors = [line.strip() for line in text.splitlines() if re.search(r"\[E\]|Error|error:", line)]
    return {"error": (errors[-1] if errors else "no estimate in its output")[:200]}


def aic_version(executable: str) -> str:
    out = subprocess.run([executable, "version"], capture_output=True, text=True, timeout=120)
    match = re.search(r"(\d+\.\d+\.\d+\S*)", out.stdout + out.stderr)
    return match.group(1) if match else "unknown"


def portable_args(args: list[str]) -> list[str]:
    """`args` with a path into lmc's catalog written from the checkout's root (lmc/planner/data/models/...), so
    the cache key is the same in every checkout."""
    from lmc.planner import catalog

    root = str(catalog.MODELS_DIR.parents[3]) + os.sep
    return [arg[len(root):] if arg.startswith(root) else arg for arg in args]


def aic_estimate(row: dict, executable: str, bundled: dict[str, str], cache: dict) -> dict:
    """aiconfigurator's estimate for the row, from the cache when the same command line was run before."""
    args = aic_args(row, bundled)
    shown = portable_args(args)
    key = hashlib.sha256(json.dumps(shown).encode()).hexdigest()[:16]
    USED_AIC_KEYS.add(key)
    if key in cache["results"]:
        return cache["results"][key]["estimate"]
    try:
        out = subprocess.run([executable, *args], capture_output=True, text=True, timeout=600)
        estimate = parse_aic_output(out.stdout + "\n" + out.stderr)
    except subprocess.TimeoutExpired:
        estimate = {"error": "timed out after 600 s"}
    cache["results"][key] = {"row": row["id"], "args": shown, "estimate": estimate}
    return estimate


USED_AIC_KEYS: set[str] = set()  # the cache entries this run read or wrote


def prune_aic_cache(cache: dict) -> dict:
    """The cache without the answers no row asked for this run (rows whose layout or lengths were corrected since)."""
    return {**cache, "results": {key: value for key, value in cache["results"].items() if key in USED_AIC_KEYS}}


def load_aic_cache(path: Path, version: str) -> dict:
    if path.is_file():
        cache = json.loads(path.read_text(encoding="utf-8"))
        if cache.get("aiconfigurator_version") == version:
            return cache
    return {"aiconfigurator_version": version, "results": {}}


# --- arithmetic ------------------------------------------------------------------------------------

def signed_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured, in %; None when either is missing."""
    if predicted is None or measured is None or measured == 0:
        return None
    return 100.0 * (predicted - measured) / measured


@dataclass
class ErrorSummary:
    median_abs: float | None
    worst_abs: float | None
    n: int


def summarize(errors: list[float | None]) -> ErrorSummary:
    values = [abs(value) for value in errors if value is not None]
    if not values:
        return ErrorSummary(None, None, 0)
    return ErrorSummary(statistics.median(values), max(values), len(values))


@dataclass
class RowResult:
    row: dict
    lmc: dict = field(default_factory=dict)
    aic: dict = field(default_factory=dict)

    def errors(self, who: str) -> dict[str, float | None]:
        figures = self.lmc if who == "lmc" else self.aic
        return {key: signed_error(figures.get(key), self.row[key]) for key in MEASURED}


def row_group(row: dict) -> str:
    """The row's source group: its id without the trailing number (dstk-r1-07 -> dstk-r1)."""
    return row["id"].rsplit("-", 1)[0]


def summary(results: list[RowResult], with_aic: bool, since: str | None = None) -> dict:
    """Rows planned/answered and the median and worst absolute % errors, overall, per source group and, with
    `since` (an ISO date), over the rows whose source is that recent (today's engines), and over those of them
    measured on vLLM, the engine every row is planned as."""
    out = _summary_of(results, with_aic)
    groups = sorted({row_group(r.row) for r in results})
    if len(groups) > 1:
        out["groups"] = {group: _summary_of([r for r in results if row_group(r.row) == group], with_aic)
                         for group in groups}
    if since:
        recent = [r for r in results if (r.row.get("source_date") or "") >= since]
        out.setdefault("groups", {})[f"since {since}"] = _summary_of(recent, with_aic)
        # the rows measured on the engine each row is planned as (lmc's vllm): no engine gap in their errors
        out["groups"][f"since {since}, vllm rows"] = _summary_of([r for r in recent if r.row["engine"] == "vllm"],
                                                                 with_aic)
    if with_aic:  # like with like: each figure over the rows where both lmc and aiconfigurator give it
        out.setdefault("groups", {})["both answer"] = _summary_of(results, with_aic, paired=True)
        if since:
            out["groups"][f"both answer, since {since}"] = _summary_of(recent, with_aic, paired=True)
    return out


def _summary_of(results: list[RowResult], with_aic: bool, paired: bool = False) -> dict:
    """`paired`: each metric over only the rows where lmc's and aiconfigurator's errors both exist."""
    out = {"rows": len(results), "lmc_planned": sum(1 for r in results if "error" not in r.lmc)}
    scored = [r for r in results if r.aic and "error" not in r.aic and "error" not in r.lmc]
    both = {metric: [r for r in scored if None not in (r.errors("lmc")[metric], r.errors("aic")[metric])]
            for metric in MEASURED} if paired else None
    for who in ("lmc", "aiconfigurator") if with_aic else ("lmc",):
        key = "lmc" if who == "lmc" else "aic"
        answered = [r for r in results if getattr(r, key) and "error" not in getattr(r, key)]
        out[f"{who}_answered"] = len(answered)
        for metric in MEASURED:
            s = summarize([r.errors(key)[metric] for r in (both[metric] if both is not None else answered)])
            out[f"{who}_{metric}"] = {"median_abs_pct": _round(s.median_abs), "worst_abs_pct": _round(s.worst_abs),
                                      "n": s.n}
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


# --- output -----------------------------------------------------------------------------------------

def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'—':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _pct(value: float | None) -> str:
    return f"{'—':>7}" if value is None else f"{value:>+7.0f}"


def print_table(results: list[RowResult], with_aic: bool) -> None:
    head = (f"{'id':<10} {'model':<34} {'hw':<8} {'eng':<6} {'isl/osl':>10} {'c':>4} | "
            f"{'TPOT':>6} {'lmc':>6} {'err%':>7} | {'TTFT':>8} {'lmc':>8} {'err%':>7} | "
            f"{'tok/s':>7} {'lmc':>7} {'err%':>7}")
    if with_aic:
        head += f" | {'aic TPOT':>8} {'err%':>7} {'aic TTFT':>8} {'err%':>7} {'aic tok/s':>9} {'err%':>7}"
    print(head + " | predictor")
    for r in results:
        row = r.row
        hw = f"{row['num_gpus']}x{row['gpu']}"
        line = (f"{row['id']:<10} {row['model'][:34]:<34} {hw[:8]:<8} {row['engine']:<6} "
                f"{row['input_len']:>5}/{row['output_len']:<4} {row['concurrency'] or 0:>4} | ")
        if "error" in r.lmc:
            line += f"PLAN FAILED: {r.lmc['error']}"
            print(line)
            continue
        e = r.errors("lmc")
        line += (f"{_fmt(row['tpot_ms'], 6)} {_fmt(r.lmc['tpot_ms'], 6)} {_pct(e['tpot_ms'])} | "
                 f"{_fmt(row['ttft_ms'], 8, 0)} {_fmt(r.lmc['ttft_ms'], 8, 0)} {_pct(e['ttft_ms'])} | "
                 f"{_fmt(row['output_throughput_tok_s'], 7, 0)} {_fmt(r.lmc['output_throughput_tok_s'], 7, 0)} "
                 f"{_pct(e['output_throughput_tok_s'])}")
        if with_aic:
            if "error" in r.aic:
                line += f" | aic: {r.aic['error'][:60]:<60}"
            else:
                a = r.errors("aic")
                line += (f" | {_fmt(r.aic.get('tpot_ms'), 8)} {_pct(a['tpot_ms'])} "
                         f"{_fmt(r.aic.get('ttft_ms'), 8, 0)} {_pct(a['ttft_ms'])} "
                         f"{_fmt(r.aic.get('output_throughput_tok_s'), 9, 0)} {_pct(a['output_throughput_tok_s'])}")
        print(line + f" | {r.lmc['predictor']}")


def markdown_table(results: list[RowResult], stats: dict, with_aic: bool) -> str:
    """The per-row table and the summary as markdown (for docs/fidelity.md)."""
    head = "| id | model | GPUs | engine | ISL/OSL | conc. | TPOT ms meas / lmc (err) | TTFT ms meas / lmc (err) | tok/s meas / lmc (err) |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    if with_aic:
        head += " aic TPOT (err) | aic TTFT (err) | aic tok/s (err) |"
        rule += "---|---|---|"
    lines = [head + " predictor |", rule + "---|"]
    for r in results:
        row = r.row
        cells = [row["id"], row["model"], f"{row['num_gpus']}x {row['gpu'].upper()}", row["engine"],
                 f"{row['input_len']}/{row['output_len']}", str(row["concurrency"])]
        if "error" in r.lmc:
            cells += [f"plan failed: {r.lmc['error']}", "", ""]
        else:
            errors = r.errors("lmc")
            cells += [_md_pair(row[key], r.lmc.get(key), errors[key]) for key in MEASURED]
        if with_aic:
            if not r.aic or "error" in r.aic:
                cells += [(r.aic or {}).get("error", "—"), "", ""]
            else:
                errors = r.errors("aic")
                cells += [_md_one(r.aic.get(key), errors[key]) for key in MEASURED]
        cells.append(r.lmc.get("predictor", "—"))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| | TPOT median / worst abs. error | TTFT median / worst | throughput median / worst | rows answered |")
    lines.append("|---|---|---|---|---|")
    for label, part in [("all rows", stats), *((f"`{group}` rows", value) for group, value in stats.get("groups", {}).items())]:
        for who in ("lmc", "aiconfigurator") if with_aic else ("lmc",):
            answered = part["lmc_planned"] if who == "lmc" else part["aiconfigurator_answered"]
            cells = [f"{_fmt_pct(part[f'{who}_{key}']['median_abs_pct'])} / {_fmt_pct(part[f'{who}_{key}']['worst_abs_pct'])} "
                     f"(n={part[f'{who}_{key}']['n']})" for key in MEASURED]
            lines.append(f"| {who}, {label} | " + " | ".join(cells) + f" | {answered} of {part['rows']} |")
    return "\n".join(lines) + "\n"


def _md_pair(measured: float | None, predicted: float | None, error: float | None) -> str:
    if measured is None:
        return f"— / {_md_num(predicted)}"
    return f"{_md_num(measured)} / {_md_num(predicted)} ({_fmt_signed(error)})"


def _md_one(predicted: float | None, error: float | None) -> str:
    return f"{_md_num(predicted)} ({_fmt_signed(error)})"


def _md_num(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _fmt_signed(value: float | None) -> str:
    return "—" if value is None else f"{value:+.0f} %"


def _fmt_pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} %"


def print_summary(stats: dict, with_aic: bool) -> None:
    print()
    print(f"rows: {stats['rows']}; lmc planned {stats['lmc_planned']}/{stats['rows']}"
          + (f"; aiconfigurator answered {stats['aiconfigurator_answered']}/{stats['rows']}" if with_aic else ""))
    for label, part in [("all rows", stats), *stats.get("groups", {}).items()]:
        for who in ("lmc", "aiconfigurator") if with_aic else ("lmc",):
            parts = []
            for metric, name in (("tpot_ms", "TPOT"), ("ttft_ms", "TTFT"), ("output_throughput_tok_s", "throughput")):
                s = part[f"{who}_{metric}"]
                parts.append(f"{name} median {_fmt_pct(s['median_abs_pct'])}, worst {_fmt_pct(s['worst_abs_pct'])} (n={s['n']})")
            print(f"{label:<12} {who:<15} " + "; ".join(parts))


# --- main -------------------------------------------------------------------------------------------

def run(rows: list[dict], aic_executable: str | None, aic_cache_path: Path) -> tuple[list[RowResult], dict | None]:
    results = []
    cache, bundled = None, {}
    if aic_executable:
        cache = load_aic_cache(aic_cache_path, aic_version(aic_executable))
        bundled = _bundled_names(aic_executable)
    for row in rows:
        result = RowResult(row)
        try:
            result.lmc = lmc_predict(row)
        except Exception as exc:  # every failure is reported; the exit code says some row failed
            result.lmc = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        if cache is not None:
            result.aic = aic_estimate(row, aic_executable, bundled, cache)
        results.append(result)
    return results, cache


def _bundled_names(executable: str) -> dict[str, str]:
    """Model ids aiconfigurator bundles configs for (its model_configs folder beside the executable's site-packages)."""
    venv = Path(executable).resolve().parent.parent
    names = {}
    for folder in venv.glob("lib/python*/site-packages/aiconfigurator_core/model_configs"):
        for path in folder.glob("*_config.json"):
            model_id = path.name[: -len("_config.json")].replace("--", "/", 1)
            names[model_id.lower()] = model_id
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="published measurements (default: %(default)s)")
    parser.add_argument("--aiconfigurator", help="aiconfigurator executable in its own virtualenv (columns skipped without)")
    parser.add_argument("--aic-cache", type=Path, default=DEFAULT_AIC_CACHE, help="aiconfigurator results cache")
    parser.add_argument("--json", type=Path, help="write the per-row results and the summary here")
    parser.add_argument("--markdown", type=Path, help="write the table and the summary as markdown here")
    parser.add_argument("--since", help="also summarise the rows whose source_date is this ISO date or later")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # catalog configs: the Hub is not reachable from the bench
    rows = load_rows(args.csv)
    with_aic = bool(args.aiconfigurator)
    if with_aic and not Path(args.aiconfigurator).exists():
        print(f"fidelity: --aiconfigurator {args.aiconfigurator}: no such file", file=sys.stderr)
        return 2
    results, cache = run(rows, args.aiconfigurator, args.aic_cache)
    if cache is not None:
        if args.csv == DEFAULT_CSV:  # every row ran: what none of them asked for is stale
            cache = prune_aic_cache(cache)
        args.aic_cache.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    stats = summary(results, with_aic, args.since)
    import lmc

    stats["lmc_version"] = getattr(lmc, "__version__", "unknown")
    stats["lmc_path"] = str(Path(lmc.__file__).resolve().parent.parent)
    if cache is not None:
        stats["aiconfigurator_version"] = cache["aiconfigurator_version"]
    print_table(results, with_aic)
    print_summary(stats, with_aic)
    if args.markdown:
        args.markdown.write_text(markdown_table(results, stats, with_aic), encoding="utf-8")
    if args.json:
        payload = {"summary": stats, "rows": [{"id": r.row["id"], "measured": {k: r.row[k] for k in MEASURED},
                                               "lmc": r.lmc, "lmc_error_pct": r.errors("lmc") if "error" not in r.lmc else None,
                                               "aiconfigurator": r.aic or None,
                                               "aiconfigurator_error_pct": (r.errors("aic") if r.aic and "error" not in r.aic
                                                                            else None)}
                                              for r in results]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 0 if stats["lmc_planned"] == stats["rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
