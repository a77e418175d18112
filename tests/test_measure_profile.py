"""`lmc calibrate`'s profile: the TOML it writes loads through the catalog's profile validation, and
a plan on it predicts from the measured figures, not engines.toml's estimates."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from lmc.errors import SpecValueError
from lmc.measure.calibrate import Calibration, EngineFigures, implausible, overhead_bound_on_gpu, solve_figures
from lmc.measure.profile import render_profile
from lmc.planner import catalog, latency
from lmc.planner.engines import engine_facts
from lmc.planner.facts import ModelFacts
from lmc.planner.memory import decode_weight_bytes

GIB = 2**30


def _calibration(**changes) -> Calibration:
    figures = dict(
        device="cpu", accelerator="cpu", devices=1, device_memory_bytes=24 * GIB, host_memory_bytes=24 * GIB,
        stream_bandwidth=40e9, matmul_tflops={"fp32": 0.22, "bf16": 1.0}, decode_bandwidth={"fp32": 19.5e9, "bf16": 24e9},
        prefill_tflops={"fp32": 0.17, "bf16": 0.6}, decode_tflops={"fp32": 0.1, "bf16": 0.4}, prefill_overhead_ms=3.0,
        step_overhead_ms=0.25, layer_overhead_ms=0.11,
        runtime_overhead_bytes=430_000_000, allreduce_latency_us=95.0, allreduce_bandwidth=1.3e9,
        allreduce_backend="gloo", load_bandwidth=2.6e9, measured_at="2026-11-25 10:00 UTC",
        host="AMD EPYC, 2 cores, load average 0.40, 0.50, 0.60")
    figures.update(changes)
    return Calibration(**figures)


def _model() -> ModelFacts:
    return ModelFacts(id="m", family="llama", architecture="LlamaForCausalLM", parameters=201_000_000, layers=8,
                      hidden_size=1536, attention_heads=12, kv_heads=4, head_dim=128, intermediate_size=4096,
                      vocab_size=384, torch_dtype="fp32", source="test")


def test_profile_loads_through_the_catalog_with_the_measured_figures(tmp_path):
    path = tmp_path / "local.toml"
    path.write_text(render_profile(_calibration()))
    facts = catalog.profile_facts(path)
    assert (facts.name, facts.kind, facts.accelerator, facts.devices) == ("local", "cpu", "cpu", 1)
    assert facts.interconnect.bandwidth_bytes_per_s == 1.3e9
    # A 4-byte all-reduce over the 2 processes measured costs, in the planner's ring model, what it took.
    assert latency.allreduce_us(facts.interconnect, 2, 4) == pytest.approx(95.0, rel=1e-3)
    assert facts.load_bandwidth_bytes_per_s == 2.6e9
    assert facts.dtypes == ["fp32", "bf16"]
    hf = facts.measured["hf"]
    assert hf.decode_bandwidth_bytes_per_s == {"fp32": 19.5e9, "bf16": 24e9}
    assert hf.prefill_tflops == {"fp32": 0.17, "bf16": 0.6} and hf.decode_tflops == {"fp32": 0.1, "bf16": 0.4}
    assert (hf.step_overhead_ms, hf.layer_overhead_ms, hf.prefill_overhead_ms, hf.runtime_overhead_bytes) == \
        (0.25, 0.11, 3.0, 430_000_000)
    # Every figure line says what was measured, and the header when and on what.
    text = path.read_text()
    assert "2026-11-25 10:00 UTC" in text.splitlines()[0] and "load average 0.40" in text
    for key in ("memory_bandwidth_bytes_per_s", "tflops", "load_bandwidth_bytes_per_s"):
        line = next(line for line in text.splitlines() if line.startswith(key + " "))
        assert "#" in line, line


def test_peaks_are_raised_to_the_achieved_figures(tmp_path):
    # A decode that beat the copy (caches) must not plan as an efficiency over 100 %.
    path = tmp_path / "local.toml"
    path.write_text(render_profile(_calibration(stream_bandwidth=15e9, matmul_tflops={"fp32": 0.1, "bf16": 1.0})))
    facts = catalog.profile_facts(path)
    assert facts.memory_bandwidth_bytes_per_s >= 24e9
    assert facts.tflops["fp32"] >= 0.17


def test_the_latency_model_reads_the_measured_figures(tmp_path):
    path = tmp_path / "local.toml"
    path.write_text(render_profile(_calibration()))
    hardware = catalog.profile_facts(path)
    engine = engine_facts()["hf"]
    model = _model()
    # TP 1: weights and KV / measured decode bandwidth + compute at the measured decode rate + fixed.
    weights = decode_weight_bytes(model, engine, "fp32", 1, hardware)
    for batch in (1, 8):
        tpot = latency.tpot_ms(model, hardware, engine, "fp32", 1, batch, 64, 64)
        kv = batch * (64 + 32) * 2 * 8 * 4 * 128 * 4
        flops = batch * (2 * latency.active_decode_parameters(model) + 4 * (64 + 32) * 12 * 128 * 8)
        expected = (weights + kv) / 19.5e9 * 1e3 + flops / 0.1e12 * 1e3 + 0.25 + 8 * 0.11
        assert tpot == pytest.approx(expected, rel=1e-3)
    tpot = latency.tpot_ms(model, hardware, engine, "fp32", 1, 1, 64, 64)
    # The prefill runs at the measured prefill rate and pays the measured request overhead.
    ttft = latency.ttft_ms(model, hardware, engine, "fp32", 1, 64)
    prefill_flops = 2 * latency.active_prefill_parameters(model) * 64 + 4 * 64 * 64 * 12 * 128 * 8
    from lmc.planner.memory import weight_bytes
    expected = (prefill_flops / 0.17e12 * 1e3 + weight_bytes(model, engine, "fp32", 1, hardware) / 19.5e9 * 1e3
                + 0.25 + 8 * 0.11 + 3.0)
    assert ttft == pytest.approx(expected, rel=1e-3)
    # bf16 plans read the bf16 figures.
    tpot_bf16 = latency.tpot_ms(model, hardware, engine, "bf16", 1, 1, 64, 64)
    assert tpot_bf16 < tpot
    # Without the measured section the same hardware predicts from engines.toml's estimates.
    unmeasured = hardware.model_copy(update={"measured": {}})
    assert not math.isclose(latency.tpot_ms(model, unmeasured, engine, "fp32", 1, 1, 64, 64), tpot, rel_tol=0.05)


def test_measured_runtime_overhead_is_the_memory_models(tmp_path):
    from lmc.planner.memory import memory_per_device

    path = tmp_path / "local.toml"
    path.write_text(render_profile(_calibration()))
    hardware = catalog.profile_facts(path)
    engine = engine_facts()["hf"]
    efficiency = latency.efficiency_for(engine, _model(), hardware)
    memory = memory_per_device(_model(), hardware, engine, efficiency, "fp32", 1, 1, 64, 64, 0.9, None)
    assert memory.runtime_overhead == 430_000_000


@pytest.mark.parametrize(("edit", "message"), [
    ("decode_bandwidth_bytes_per_s = { fp32 = 9e10, bf16 = 2.4e10 }", "exceeds memory_bandwidth_bytes_per_s"),
    ("[measured.hff]", "measured.hff"),
    ("step_overhead_ms = -1.0", "step_overhead_ms"),
])
def test_a_bad_measured_section_is_one_line_under_target_profile(tmp_path, edit, message):
    text = render_profile(_calibration())
    key = edit.split(" ")[0]
    lines = text.splitlines()
    if key.startswith("[measured."):
        lines = [edit if line == "[measured.hf]" else line for line in lines]
    else:
        lines = [edit if line.startswith(key + " ") else line for line in lines]
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecValueError) as error:
        catalog.profile_facts(path)
    assert error.value.key_path == "target.profile"
    assert message in error.value.detail and "\n" not in error.value.detail


def test_disturbed_figures_are_recognised():
    assert implausible(40e9, {"fp32": 0.2}, {"fp32": EngineFigures(20e9, 0.17, 0.1)}) is None
    assert "decode fp32" in implausible(40e9, {"fp32": 0.2}, {"fp32": EngineFigures(350e9, 0.17, 0.1)})
    assert "prefill fp32" in implausible(40e9, {"fp32": 0.2}, {"fp32": EngineFigures(20e9, 1.3, 0.1)})
    assert "less than the fixed costs" in implausible(40e9, {"fp32": 0.2}, {"fp32": None})


def test_on_a_gpu_unsolvable_rates_take_the_device_measurements():
    """The H200 case: the hf engine's steps are its fixed costs, so fp16 solves to nothing and bf16 to a
    decode rate beyond the copy's; both take the copy bandwidth and the matmul rate, with a note. A
    solved, plausible dtype keeps its figures."""
    stream, matmul = 3.85e12, {"fp16": 747.0, "bf16": 778.0, "fp32": 50.0}
    plausible = EngineFigures(3.0e12, 40.0, 30.0)
    figures, note = overhead_bound_on_gpu(stream, matmul, {"fp16": None, "bf16": EngineFigures(9e12, 400.0, 200.0),
                                                           "fp32": plausible})
    assert figures == {"fp16": EngineFigures(stream, 747.0, 747.0), "bf16": EngineFigures(stream, 778.0, 778.0),
                       "fp32": plausible}
    assert note.startswith("fp16, bf16: the hf engine's steps on this GPU are its fixed costs")
    assert implausible(stream, matmul, figures) is None  # no retry follows
    assert overhead_bound_on_gpu(stream, matmul, {"fp32": plausible}) == ({"fp32": plausible}, None)


def test_solved_rates_reproduce_the_measured_times():
    """calibrate turns times into rates with the planner's own model: given times that model predicts
    for known rates, solving from rough guesses gives those rates back."""
    from lmc.measure import calibrate as cal

    model = _model()
    truth = EngineFigures(decode_bandwidth=18e9, prefill_tflops=0.16, decode_tflops=0.05)
    engine = engine_facts()["hf"]
    hardware = cal._calibration_hardware("fp32", truth, 0.3, 0.1)
    tpot_1 = latency.tpot_ms(model, hardware, engine, "fp32", 1, 1, cal._DECODE_PROMPT, cal._DECODE_TOKENS)
    tpot_8 = latency.tpot_ms(model, hardware, engine, "fp32", 1, 8, cal._DECODE_PROMPT, cal._DECODE_TOKENS)
    ttft = latency.ttft_ms(model, hardware, engine, "fp32", 1, cal._PREFILL_TOKENS)
    solved = solve_figures(model, "fp32", 0.3, 0.1, tpot_1, tpot_8, ttft, EngineFigures(40e9, 0.5, 0.5))
    assert solved.decode_bandwidth == pytest.approx(18e9, rel=0.01)
    assert solved.prefill_tflops == pytest.approx(0.16, rel=0.01)
    assert solved.decode_tflops == pytest.approx(0.05, rel=0.01)
    # A step shorter than the fixed costs alone cannot be solved: a disturbed measurement.
    assert solve_figures(model, "fp32", 0.3, 0.1, 0.5, tpot_8, ttft, EngineFigures(40e9, 0.5, 0.5)) is None


def test_fixed_costs_come_from_the_typical_run_not_the_luckiest():
    """The plan predicts the typical (p50) step, so the engine's fixed costs come from the median served runs:
    a host that now and then runs a request fast (or slow) moves the fastest-of-five figures, not these."""
    from lmc.measure.calibrate import fixed_costs

    step, layer, request = 1.0, 0.5, 4.0  # ms; per token = step + layers · layer

    def runs(layers: int, tokens: int) -> list[float]:
        typical = request + tokens * (step + layers * layer)
        return [0.8 * typical, 0.99 * typical, typical, 1.01 * typical, 1.6 * typical]  # one lucky, one stalled

    got = fixed_costs({n: (runs(n, 32), runs(n, 2)) for n in (2, 12)})
    assert got == pytest.approx((step, layer, request), rel=0.03)
    # the fastest runs alone would give a step 20 % short: what the figures were taken from before
    lucky = fixed_costs({n: ([min(runs(n, 32))], [min(runs(n, 2))]) for n in (2, 12)})
    assert lucky[0] + 8 * lucky[1] < 0.85 * (step + 8 * layer)


def test_calibrate_usage_errors_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lmc", "calibrate", "--dtypes", "int8"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "--dtypes 'int8': choose from fp32, bf16 on cpu" in result.stderr and result.stderr.count("\n") == 1
    result = subprocess.run([sys.executable, "-m", "lmc", "calibrate", "--out", str(tmp_path / "no" / "p.toml")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "its directory does not exist" in result.stderr
