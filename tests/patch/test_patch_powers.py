"""Powers and roots in the rescaling algebra: x ** 2 (square) is homogeneous of degree 2,
sqrt of degree 1/2, so conv -> sqrt(a² + b²) -> conv carries p, p², p², p and the next conv
absorbs p (an STFT magnitude: Silero VAD on raw samples). Ground truth: a real FP16 run on
the CPU (``copy.deepcopy(m).half()``)."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch

import fp16lens
from fp16lens._core.algebra import Kind, exact_powers, op_kind
from fp16lens.patch import get_plan, patch, relative_error

from models import magnitude


def _report(model, inputs):
    with fp16lens.watch(model) as lens, torch.no_grad():
        model(*inputs)
    return lens.report


@torch.no_grad()
def _fp16(model, inputs):
    return copy.deepcopy(model).half()(*(x.half() for x in inputs)).float()


@pytest.mark.parametrize("inner", ["pow", "square"])
def test_magnitude_overflow_fixed_by_rescaling(inner):
    model, inputs = magnitude(inner)
    with torch.no_grad():
        ref = model(*inputs)
    assert not torch.isfinite(_fp16(model, inputs)).all()  # the planted overflow: the squares
    patched = patch(model, _report(model, inputs))
    plan = get_plan(patched)
    assert plan.unresolved == [] and plan.islands == []
    scales = {r.module: (r.s_in, r.s_out) for r in plan.reparametrized}
    s_stft, s_head = scales["stft"], scales["head"]
    assert s_stft[0] == 1 and s_head == (s_stft[1], 1)  # the exit absorbs what the entry gave
    with torch.no_grad():
        assert relative_error(ref, patched(*inputs)) <= 1e-5
    got = _fp16(patched, inputs)
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) >= 0.999


@pytest.mark.parametrize("inner", ["exp", "tensor"])
def test_no_scale_passes_exp_or_a_tensor_exponent(inner):
    model, inputs = magnitude(inner, peak=60.0 if inner == "exp" else 3e3)
    report = _report(model, inputs)
    assert report.spans  # exp(60) and |a| ** t overflow
    patched = patch(model, report)
    plan = get_plan(patched)
    assert plan.unresolved and not any(r.module == "stft" for r in plan.reparametrized)


def test_degrees_and_exact_powers():
    assert op_kind("pow", 1) == Kind.POWER and op_kind("sqrt", 1) == Kind.POWER
    assert op_kind("pow", 2) == Kind.OPAQUE and op_kind("exp", 1) == Kind.OPAQUE
    assert exact_powers(5.0, [Fraction(1), Fraction(1, 2)]) == 16.0  # sqrt: an even power
    assert exact_powers(5.0, [Fraction(1), Fraction(2)]) == 8.0


def test_a_pow_of_another_exponent_falls_back_and_stays_exact():
    """The report names ``pow``, not its exponent: taken as the square, |a| ** 3 fails the
    FP32 check, and patch plans again with every pow opaque instead of raising."""
    model, inputs = magnitude("cube", peak=60.0)  # |a|³ ≈ 2e5: beyond FP16 at the cubes
    report = _report(model, inputs)
    assert report.spans and not torch.isfinite(_fp16(model, inputs)).all()
    patched = patch(model, report)
    with torch.no_grad():
        assert relative_error(model(*inputs), patched(*inputs)) <= 1e-5
    the_plan = get_plan(patched)
    assert the_plan.unresolved or the_plan.islands  # the cubes are not rescaled as squares
