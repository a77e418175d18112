"""Shared test set-up: small thread counts (the CI machine has 2 cores), GPU skipping, and the extended
cases CI leaves out (LMC_EXTENDED_TESTS=1 runs them)."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# An empty Hugging Face home of the run's own: plans of Hub ids must not depend on what a developer's
# cache holds (tests that exercise the cache point HF_HOME/HF_HUB_CACHE at their own folders).
_HF_HOME = tempfile.mkdtemp(prefix="lmc-tests-hf-home-")
os.environ["HF_HOME"] = _HF_HOME
os.environ["HF_HUB_CACHE"] = os.path.join(_HF_HOME, "hub")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none here; run on a GPU host)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
    # Extended end-to-end cases (a vLLM start each) that CI leaves out to stay within its 20 minutes.
    if os.environ.get("LMC_EXTENDED_TESTS") != "1" and "extended" not in (config.option.markexpr or ""):
        skip = pytest.mark.skip(reason="extended: run with LMC_EXTENDED_TESTS=1 (left out of CI for time)")
        for item in items:
            if item.get_closest_marker("extended"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def cpu_checkpoint():
    """The checkpoints the CPU example specs name by model.path (specs/models/, which git ignores):
    tiny-llama-cpu's tiny random Llama, returned, and tiny-llama-cpu-vllm's, heads of 32 (vLLM's CPU
    kernels' smallest)."""
    from pathlib import Path

    from lmc.testing.checkpoints import make_checkpoint

    models = Path(__file__).resolve().parents[1] / "specs" / "models"
    make_checkpoint("llama", models / "tiny-llama-vllm", seed=0, hidden_size=128, intermediate_size=256)
    return make_checkpoint("llama", models / "tiny-llama", seed=0)
