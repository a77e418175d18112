"""Shared test set-up: small thread counts (the CI machine has 2 cores) and GPU skipping."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
