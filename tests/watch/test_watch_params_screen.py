"""The parameter check reads each tensor once (a norm per chunk) and runs its exact passes
only where that pass cannot rule a problem out: the checks are those of the exact passes
on every tensor, and an ordinary model needs no exact pass at all."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from fp16lens._core.flush import flush_loss
from fp16lens.watch import _params
from fp16lens.watch._options import WatchOptions

import models


def _exact(model, options):
    """The reference: both exact passes on every tensor (what the check did before)."""
    out = []
    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in named:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        a = t.detach().abs()
        over = _params._overflow(name, t, a, options.threshold)
        if over is not None:
            out.append(repr((over, False, None)))
        if name.rpartition(".")[2] not in ("running_mean", "running_var"):
            small = _params._small(name, a.float(), options)
            if small is not None:
                out.append(repr((small, name.endswith("bias"), flush_loss(t))))
    return out


def _checks(model, options):
    return [repr((c.finding, c.additive, c.loss)) for c in _params.check_parameters(model, options)]


def _random_tensors(seed: int, count: int):
    """Tensors mixing scales from 1e-9 to 1e6, zeros, inf/NaN, in every float dtype."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        n = rng.choice([1, 100, 4095, 4096, 4097, 30000])
        t = torch.randn(n, generator=gen) * 10 ** rng.uniform(-9, 6)
        t[: rng.randint(0, n)] *= 10 ** rng.uniform(-6, 0)
        if rng.random() < 0.2:
            t[rng.randrange(n)] = rng.choice([math.inf, math.nan])
        if rng.random() < 0.2:
            t[: rng.randint(0, n)] = 0
        m = nn.Module()
        m.register_parameter(
            rng.choice(["weight", "bias"]),
            nn.Parameter(
                t.to(rng.choice([torch.float32, torch.float16, torch.float64, torch.bfloat16])),
                requires_grad=False,
            ),
        )
        m.register_buffer("running_var", t.abs() * 3)
        options = WatchOptions(
            threshold=rng.choice([65504.0, 1.0]),
            param_subnormal_share=rng.choice([0.05, 0.0, 0.5]),
            param_underflow_share=rng.choice([0.01, 0.0]),
        )
        yield m, options


def _problem_models():
    yield models.bn_huge_var()[0], WatchOptions()
    yield models.mobilenet_v2_tiny_params()[0], WatchOptions()
    yield models.layer_scale_readout()[0], WatchOptions()
    yield models.seed_case()[0], WatchOptions(threshold=1.0)
    yield from _random_tensors(0, 60)


def test_same_checks_as_the_exact_passes():
    cases = list(_problem_models())
    screened = [_checks(m, o) for m, o in cases]
    exact = [_exact(m, o) for m, o in cases]
    assert sum(map(len, exact)) > 40  # overflow, subnormal and flush findings to compare
    assert screened == exact


@pytest.fixture
def exact_passes(monkeypatch):
    ran = []
    for name in ("_overflow", "_small"):
        real = getattr(_params, name)
        monkeypatch.setattr(
            _params, name, lambda *a, _real=real, _n=name: (ran.append((_n, a[0])), _real(*a))[1]
        )
    return ran


def test_an_ordinary_model_needs_no_exact_pass(exact_passes):
    torch.manual_seed(0)
    # weights at their usual initial scales (mean |w| > 2^-14 / 1% * 1.25 ~ 0.008: a wider
    # Linear's 1/sqrt(fan_in) init is smaller, and its exact pass runs)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3),
        nn.BatchNorm2d(64),
        nn.Flatten(),
        nn.Linear(64, 30000),
        nn.LayerNorm(30000),
        nn.Embedding(3000, 256),
    )
    assert _params.check_parameters(model, WatchOptions()) == []
    assert exact_passes == []
    with torch.no_grad():  # one value past FP16 (ground truth: .half() makes it inf)
        model[3].weight[7, 11] = 1e5
    assert torch.isinf(model[3].weight.half()).sum() == 1
    (check,) = _params.check_parameters(model, WatchOptions())
    assert check.finding.count == 1 and check.finding.tensor == "weight"
    assert exact_passes == [("_overflow", "3.weight")]
