"""A flushed guard (a positive eps kept as a bias) is harmless only where the values it
joins never flush on their way to a singular op (``watch/_harm.py``). Ground truth: real
FP16 (``copy.deepcopy(model).half()``)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fp16lens import watch


class LogPower(nn.Module):
    """log(x² + eps), the eps a parameter named bias; ``conv``: the same sum read by a
    linear layer instead of a log."""

    def __init__(self, conv: bool = False):
        super().__init__()
        self.bias = nn.Parameter(torch.full((16,), 1e-10))
        self.head = nn.Linear(16, 4) if conv else None

    def forward(self, x):
        y = x * x + self.bias
        return self.head(y) if self.head is not None else torch.log(y)


def _quiet() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return 10.0 ** (torch.rand(8, 16, generator=g) * 6 - 6)  # 1e-6 .. 1


def _check(model):
    x = _quiet()
    with torch.no_grad():
        half = copy.deepcopy(model).half()(x.half()).float()
        with watch(model) as lens:
            ref = model(x)
    (f,) = [f for f in lens.report.findings if f.tensor == "bias"]
    return f, bool((~half.isfinite() & ref.isfinite()).any())


def test_a_vanished_eps_before_a_log_is_a_problem():
    f, breaks = _check(LogPower().eval())
    assert breaks  # real FP16: log(0) = -inf
    assert f.mechanism == "parameter" and "flush too" in f.detail and "log" in f.detail and f.fix


def test_the_same_eps_before_a_linear_stays_a_note():
    f, breaks = _check(LogPower(conv=True).eval())
    assert not breaks
    assert f.mechanism == "note" and "harmless" in f.detail
