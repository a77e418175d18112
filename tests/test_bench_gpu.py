"""bench/gpu/gpu_loop.py without a GPU: its arguments, its one-line stop, and its table on fake figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmc.schema import load_spec

try:
    from _scripts import load_script
except ImportError:  # tests/ imported as a package
    from tests._scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu" / "gpu_loop.py"


@pytest.fixture(scope="module")
def loop():
    return load_script("bench/gpu/gpu_loop.py")


def test_arguments(loop):
    args = loop.parse_args([])
    assert args.engines == ["hf", "deepspeed", "vllm"] and args.levels == [1, 8, 32]
    args = loop.parse_args(["--engines", "vllm,hf", "--concurrency", "8,1"])
    assert args.engines == ["vllm", "hf"] and args.levels == [1, 8]


@pytest.mark.parametrize(("argv", "message"), [
    (["--engines", "tgi"], "choose from hf, deepspeed, vllm"),
    (["--concurrency", "1,x"], "comma-separated whole numbers"),
    (["--concurrency", "0"], "levels of at least 1"),
    (["--output-tokens", "1"], "--output-tokens at least 2"),
    (["--layers", "0"], "--layers 0: at least 1"),
])
def test_bad_arguments_exit_2(loop, argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        loop.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_without_cuda_it_stops_at_once_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the loop would run")
    result = subprocess.run([sys.executable, str(SCRIPT), "--work", str(tmp_path / "work")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr == "gpu_loop: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU host\n"
    assert not (tmp_path / "work").exists()  # nothing was started or written


@pytest.mark.parametrize(("name", "accelerator"), [
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A10G", "a10g"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("Tesla T4", "t4"), ("NVIDIA H200", "h200"),
])
def test_gpu_names_map_to_catalog_accelerators(loop, name, accelerator):
    from lmc.planner.catalog import list_accelerators

    assert loop.accelerator_for(name) == accelerator and accelerator in list_accelerators()


def test_an_unknown_gpu_asks_for_accelerator(loop):
    with pytest.raises(loop.LoopError, match="pass --accelerator"):
        loop.accelerator_for("Radeon Instinct MI300X")


@pytest.mark.parametrize("engine", ["hf", "deepspeed", "vllm"])
def test_specs_are_valid_and_pin_the_engine(loop, tmp_path, engine):
    path = tmp_path / "spec.toml"
    path.write_text(loop.spec_text(engine, "h100-80gb", 128, 64, 32))
    spec = load_spec(path).spec
    assert (spec.pin.engine, spec.pin.dtype, spec.pin.tensor_parallel_degree) == (engine, "fp16", 1)
    assert (spec.target.accelerator, spec.target.devices, spec.target.profile) == ("h100-80gb", 1, "profile.toml")
    assert spec.workload.concurrency == 32


def test_fewer_layers_name_their_own_checkpoint(loop, tmp_path):
    assert loop.parse_args([]).layers == 32 and loop.parse_args(["--layers", "8"]).layers == 8
    path = tmp_path / "spec.toml"
    path.write_text(loop.spec_text("hf", "h200", 128, 64, 32, layers=8))
    spec = load_spec(path).spec
    assert (spec.model.id, spec.model.path) == ("lmc/random-llama-7b-8-layers", "llama-7b-8-layers")
    assert loop.checkpoint_name(32) == "llama-7b"  # the full model keeps its name (and a checkpoint already written)


def test_children_keep_the_pythonpath_they_were_given(loop, monkeypatch):
    """On the GPU host lmc's wheels may sit on PYTHONPATH: the loop's subprocesses put the repository
    first and keep the rest."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert loop._env()["PYTHONPATH"].split(":") == [str(loop.ROOT), "/tmp/site"]


def test_roofline_is_weight_bytes_over_bandwidth(loop):
    assert loop.roofline_ms(13.0e9, 3.35e12) == pytest.approx(3.8806, rel=1e-4)


def _bench(tpot_1: float) -> dict:
    return {"peak_worker_memory_bytes": 15 * 2**30,
            "levels": [{"concurrency": c, "tpot_ms": {"p50": tpot_1 * (1 + (c - 1) / 64)}, "output_tokens_per_s": 60.0 * c}
                       for c in (1, 8, 32)]}


def test_the_table_puts_engines_side_by_side_with_device_and_date(loop):
    plan = {"memory_per_device": {"total": 14 * 2**30}, "predicted": {"tpot_ms": 5.0}}
    rows = [loop.engine_row("hf", "NVIDIA H100 80GB HBM3", "2026-11-25 11:00 UTC", plan, _bench(16.0),
                            {"flagged": 2}, 13 * 2**30, 4.0, True, None),
            loop.engine_row("vllm", "NVIDIA H100 80GB HBM3", "2026-11-25 11:00 UTC", None, None, None, None, None, None,
                            "lmc plan exited 1: pin.engine = 'vllm': unknown engine")]
    assert rows[0]["tpot_over_roofline"] == 4.0
    assert rows[0]["throughput_tokens_per_s"] == {"1": 60.0, "8": 480.0, "32": 1920.0}
    text = loop.render_table(rows, [1, 8, 32])
    header, hf_line, vllm_line = text.splitlines()
    assert header.split()[:5] == ["engine", "openai", "TPOT", "b1", "ms"]
    assert hf_line.split()[:11] == ["hf", "ok", "16.0", "4.0", "4.00", "60.0", "480.0", "1920.0", "15.0", "13.0", "14.0"]
    assert hf_line.endswith("NVIDIA H100 80GB HBM3, 2026-11-25 11:00 UTC")
    assert vllm_line.startswith("vllm") and "not run: lmc plan exited 1" in vllm_line
    assert vllm_line.endswith("(NVIDIA H100 80GB HBM3, 2026-11-25 11:00 UTC)")


@pytest.mark.parametrize("name", ["profile_decode", "step_spread"])
def test_gpu_scripts_without_cuda_stop_with_one_line(name):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    result = subprocess.run([sys.executable, str(SCRIPT.parent / f"{name}.py")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert result.stderr == f"{name}: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU host\n"
