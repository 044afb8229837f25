"""Markers for hardware and heavy dependencies, skipped with a reason when missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_REASONS = {
    "gpu": (lambda: torch.cuda.is_available(), "needs a CUDA GPU"),
    "tensorrt": (
        lambda: torch.cuda.is_available() and _has("tensorrt"),
        "needs TensorRT and a GPU: pip install -e '.[trt]' on a GPU machine",
    ),
    "torchtrt": (
        lambda: torch.cuda.is_available() and _has("torch_tensorrt"),
        "needs torch-tensorrt and a GPU: pip install -e '.[torchtrt]' on a GPU machine",
    ),
}


def pytest_collection_modifyitems(config, items):
    available = {name: check() for name, (check, _) in _REASONS.items()}
    for item in items:
        for name, (_, reason) in _REASONS.items():
            if name in item.keywords and not available[name]:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
