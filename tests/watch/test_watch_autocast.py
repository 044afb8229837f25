"""watch under torch.autocast(float16): the values are FP16's own, so watch says so.

Users run inference under ``torch.autocast`` and wrap that call in ``fp16lens.watch``, or a
model's own forward enters autocast. Ground truth, without fp16lens: the model's output
under autocast is float16 and inf/NaN, where the FP32 model is finite; forward hooks name
the first module whose output is inf there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import fp16lens
from fp16lens._core import PatchError, WatchError
from fp16lens._core.sites import FindingKind

import models


class Autocast(nn.Module):
    """``inner`` run under torch.autocast on the CPU inside this forward."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x):
        with torch.autocast("cpu", dtype=self.dtype):
            return self.inner(x)


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _first_inf(model: nn.Module, x: torch.Tensor) -> str | None:
    """The first leaf module whose output holds inf or NaN, by plain forward hooks: the
    seed article's way, ``scripts/reproduce_seed_case.py``'s ``first_nonfinite_module``."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "reproduce_seed_case.py"
    spec = importlib.util.spec_from_file_location("reproduce_seed_case", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.first_nonfinite_module(model, x)


def test_a_forward_under_autocast_float16_is_refused_and_nothing_is_left():
    model, (x,) = models.relu_span()
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
        with torch.autocast("cpu", dtype=torch.float16):  # ground truth: FP16's own values
            out = model(x)
    assert out.dtype == torch.float16 and not torch.isfinite(out).all()
    with (
        pytest.raises(WatchError) as info,
        torch.autocast("cpu", dtype=torch.float16),
        fp16lens.watch(model),
    ):
        model(x)
    assert "autocast" in str(info.value) and "without autocast" in str(info.value)
    assert _hooks(model) == 0
    with fp16lens.watch(model) as lens:  # the same model watched in FP32 finds the span
        model(x)
    assert [s.start for s in lens.report.spans] == ["fc1"]


def test_autocast_inside_forward_is_named_and_the_span_starts_where_fp16_overflows():
    inner, (x,) = models.relu_span()
    model = Autocast(inner, torch.float16).eval()
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.float16 and not torch.isfinite(out).all()
    assert _first_inf(model, x) == "inner.fc1"  # ground truth

    with fp16lens.watch(model) as lens:
        got = model(x)
    assert got.dtype == out.dtype and torch.equal(got.isnan(), out.isnan())  # bit for bit
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(out))
    report = lens.report
    assert not report.clean
    assert report.spans[0].start == "inner.fc1"
    kinds = [f.kind for f in report.findings]
    assert FindingKind.FP16_INSIDE in kinds and FindingKind.MASK_CONSTANT not in kinds
    (first,) = [
        f for f in report.findings if f.site == "inner.fc1" and f.kind == FindingKind.NONFINITE
    ]
    assert "float16" in first.detail and "already in FP32" not in first.detail
    with pytest.raises(PatchError, match="autocast"):
        fp16lens.patch(model, report)


def test_autocast_bfloat16_holds_fp32_range_and_is_watched():
    inner, (x,) = models.relu_span()
    model = Autocast(inner, torch.bfloat16).eval()
    with fp16lens.watch(model) as lens:
        model(x)
    report = lens.report
    assert [s.start for s in report.spans] == ["inner.fc1"]
    assert all(f.kind != FindingKind.FP16_INSIDE for f in report.findings)
