"""Shared test set-up: small thread counts (the CI machine has 2 cores) and GPU skipping."""

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
