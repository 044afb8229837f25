"""Watching a patched model again finds nothing: islands store FP32 values by design."""

from __future__ import annotations

import copy

import pytest
import torch

import models
from fp16lens import patch, watch


@pytest.mark.parametrize("name", ["gelu_span", "seed_case", "bn_huge_var"])
def test_patched_model_watches_clean(name):
    model, inputs = models.WATCH_CASES[name]()
    with torch.no_grad(), watch(model) as lens:
        model(*inputs)
    assert not lens.report.clean
    patched = patch.patch(model, lens.report)
    with torch.no_grad(), watch(patched) as again:
        patched(*inputs)
    assert again.report.spans == []
    assert again.report.findings_by("parameter") == []
    half = copy.deepcopy(patched).half()
    with torch.no_grad():
        out = half(*[t.half() for t in inputs])
    assert torch.isfinite(out).all()
