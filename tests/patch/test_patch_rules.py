"""Every rescaling rule checked in float64 algebra against the unmodified torch module,
and the power-of-two folds checked bit-exact in float32."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16lens._core import FP16_MAX, FP16_MIN_NORMAL
from fp16lens._core.algebra import choose_factor
from fp16lens.patch import bn_affine, scale_bn, scale_linear, scale_norm_eps
from fp16lens.patch._rules import bn_affine_stats

P_VALUES = [2.0, 8.0, 64.0, 4096.0]


def _bn(c: int = 6) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-3, 3)
        bn.running_var.uniform_(0.1, 5.0)
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1, 1)
    return bn


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("s_in_is_p", [True, False])
def test_scale_linear_float64_algebra(p, s_in_is_p):
    conv = nn.Conv2d(3, 5, 3, padding=1).double()
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64) * 100
    s_in, s_out = (p, 1.0) if s_in_is_p else (1.0, p)
    w, b = scale_linear(conv.weight, conv.bias, s_in, s_out)
    got = F.conv2d(x / s_in, w, b, padding=1)
    torch.testing.assert_close(got, conv(x) / s_out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", P_VALUES)
def test_power_of_two_entry_fold_is_bit_exact_in_float32(p):
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16) * 10
    w, b = scale_linear(lin.weight, lin.bias, 1.0, p)
    assert torch.equal(F.linear(x, w, b), lin(x) / p)  # W/p, b/p: no rounding at all


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize(("s_in", "s_out"), [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_scale_bn_float64_algebra(p, s_in, s_out):
    s_in, s_out = (p if s_in == 0 else 1.0), (p if s_out == 0 else 1.0)
    bn = _bn().double()
    x = torch.randn(2, 6, 4, 4, dtype=torch.float64) * 50
    m, v, eps, w, b = scale_bn(
        bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, s_in, s_out
    )
    got = F.batch_norm(x / s_in, m, v, w, b, False, 0.0, eps)
    torch.testing.assert_close(got, bn(x) / s_out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", P_VALUES)
def test_scale_bn_exit_is_bit_exact_in_float32(p):
    bn = _bn()
    y = torch.randn(2, 6, 4, 4) * 1000
    m, v, eps, w, b = scale_bn(bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, p, 1.0)
    assert torch.equal(F.batch_norm(y / p, m, v, w, b, False, 0.0, eps), bn(y))


@pytest.mark.parametrize(("s_in", "s_out"), [(1.0, 1.0), (16.0, 1.0), (1.0, 32.0), (8.0, 2.0)])
def test_bn_affine_float64_algebra(s_in, s_out):
    bn = _bn().double()
    x = torch.randn(2, 6, 4, 4, dtype=torch.float64) * 50
    scale, shift = bn_affine(
        bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias, s_in, s_out
    )
    got = (x / s_in) * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)
    torch.testing.assert_close(got, bn(x) / s_out, rtol=1e-12, atol=1e-12)
    # stored in a BatchNorm with mean 0, var c^2 - eps and its own eps (patch's form), the
    # weight carrying c, it computes the same
    v, c = bn_affine_stats(bn.eps)
    var = torch.full((6,), v, dtype=torch.float64)
    stored = F.batch_norm(
        x / s_in, torch.zeros(6).double(), var, scale * c, shift, False, 0.0, bn.eps
    )
    # in float64 var + eps is c^2 within 2^-25 (the form is exact in FP32, test_patch_bn_eps)
    torch.testing.assert_close(stored, bn(x) / s_out, rtol=2**-23, atol=1e-7)


def test_bn_affine_makes_huge_running_var_fp16_safe():
    bn = _bn()
    with torch.no_grad():
        bn.running_var.fill_(1.0e7)
    assert not torch.isfinite(bn.running_var.half()).all()  # the problem
    scale, shift = bn_affine(bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias)
    assert torch.isfinite(scale.half()).all() and torch.isfinite(shift.half()).all()
    assert float(scale.abs().min()) >= FP16_MIN_NORMAL


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize(
    "norm", [nn.LayerNorm(12), nn.GroupNorm(3, 12), nn.InstanceNorm1d(12), nn.RMSNorm(12, eps=1e-5)]
)
def test_norms_are_scale_invariant_with_eps_over_p_squared(norm, p):
    norm = copy.deepcopy(norm).double().eval()
    x = torch.randn(2, 12, 12, dtype=torch.float64) * 3
    want = norm(x)
    norm.eps = scale_norm_eps(norm.eps, p)
    torch.testing.assert_close(norm(x / p), want, rtol=1e-12, atol=1e-12)


def test_homogeneous_ops_commute_with_power_of_two_in_float32():
    x = torch.randn(1, 4, 8, 8) * 100
    p = 64.0
    ops = [
        F.relu,
        lambda t: F.leaky_relu(t, 0.1),
        lambda t: F.max_pool2d(t, 2),
        lambda t: F.avg_pool2d(t, 2),
        lambda t: F.interpolate(t, scale_factor=2, mode="nearest"),
        lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=False),
        lambda t: F.pad(t, (1, 1, 1, 1)),
        lambda t: torch.cat([t, t * 0.5], 1),
        lambda t: F.adaptive_avg_pool2d(t, 1),
    ]
    for op in ops:
        assert torch.equal(op(x / p), op(x) / p)


def test_choose_factor_lands_peak_near_2_to_13():
    p = choose_factor([(2.72e5, 1)], low=1e-2, target=2.0**13)
    assert p == 64.0 and 2.72e5 / p <= 2.0**13


def test_choose_factor_keeps_small_values_normal_when_peak_allows():
    # the peak alone asks for 64; values down to 2^-9 allow only 32 (2^-9 / 32 = 2^-14)
    p = choose_factor([(2.72e5, 1)], low=2.0**-9, target=2.0**13)
    assert p == 32.0 and 2.72e5 / p < FP16_MAX


def test_choose_factor_never_leaves_fp16_range_for_small_values():
    p = choose_factor([(1.0e6, 1)], low=2.0**-12, target=2.0**13)
    assert 1.0e6 / p <= FP16_MAX / 2 and math.log2(p) == int(math.log2(p))


def test_choose_factor_square_quantities_use_the_square_root():
    p = choose_factor([(2.53e6, 2)], low=0.0, target=2.0**13)
    assert p == 32.0 and 2.53e6 / p**2 <= 2.0**13
