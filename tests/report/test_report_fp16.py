"""The view and the advice of real watched reports, checked against real FP16 on CPU.

Each fix worded from the report alone (``watch(..., advise=False)``: what a report without
a model to plan on says) is applied by hand exactly as its sentence says and the model is
run in half precision (or, for decomposed norms and sums, the explicit FP16 computation):
the advice must remove the overflow and keep the FP32 result. The advice of a report
watched with planning is patch's plan (tests/patch/test_advice_is_the_plan.py).
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

import fp16lens
from fp16lens import watch
from fp16lens.report._advice import suggest_fix
from fp16lens.report._spanfix import rescale_exponent, side_inputs

import models


def _watched(builder, advise: bool = False):
    model, inputs = builder()
    with torch.no_grad(), watch(model, advise=advise) as lens:
        ref = model(*inputs)
    return model, inputs, ref, lens.report


@pytest.fixture(scope="module")
def seed():
    return _watched(models.seed_case)


def _half(model, inputs):
    with torch.no_grad():
        return copy.deepcopy(model).half()(*(x.half() for x in inputs)).float()


@torch.no_grad()
def _reparametrize_bn(bn: torch.nn.BatchNorm2d, out_scale: float = 1.0) -> None:
    """The advised exact affine re-parametrization (times out_scale: a rescale's exit)."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    bn.bias.copy_(bn.bias - bn.running_mean * scale)
    bn.weight.copy_(scale * out_scale)
    bn.running_mean.zero_()
    bn.running_var.fill_(1 - bn.eps)  # as advised: running_var = 1 - eps, eps kept


def test_watched_seed_report_renders_its_span_path():
    model, _, _, report = _watched(models.seed_case, advise=True)
    console = Console(width=400, color_system=None, record=True, file=io.StringIO())
    report.print(console=console)
    text = console.export_text()
    assert (
        "backbone.layer4.1.bn2 → backbone.layer4.1:add → backbone.layer4.1.relu → "
        "neck.reduce_c5.0 → neck.reduce_c5.1 (back in range)"
    ) in text
    # tests/watch checks this start against models.first_inf_site_fp16 (real FP16).
    assert report.spans[0].start == "backbone.layer4.1.bn2"
    k = round(math.log2(fp16lens.patch.plan(model, report).regions[0].factor))  # what patch does
    assert f"Next: patch: rescale by 2^-{k} (the peak" in text
    assert "[beyond 65504 ×32] neck.reduce_c5.1.running_var" in text


@torch.no_grad()
def test_seed_advice_applied_as_written_fixes_real_fp16(seed):
    model, inputs, ref, report = seed
    span = report.spans[0]
    k = rescale_exponent(span.peak)
    p = 2.0**k
    assert f"rescale by 2^-{k} folded into {span.start} parameters" in suggest_fix(report, span)
    assert side_inputs(report, span) == [("backbone.layer4.0.relu", "backbone.layer4.1:add")]
    assert not torch.isfinite(_half(model, inputs)).all()  # the problem is real

    fixed = copy.deepcopy(model)
    entry = fixed.get_submodule(span.start)
    entry.weight /= p
    entry.bias /= p
    # The side input: layer4.0's output enters layer4.1 (its add, and conv1 which absorbs p).
    block = fixed.backbone.layer4[1]
    block.register_forward_pre_hook(lambda _, args: (args[0] / p,))
    block.conv1.weight *= p
    # The exit undoes 2^k; its running_var needs the re-parametrization of its finding.
    _reparametrize_bn(fixed.get_submodule(span.end), out_scale=p)
    torch.testing.assert_close(fixed(*inputs), ref, atol=1e-5, rtol=1e-4)  # exact in FP32
    out = _half(fixed, inputs)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 5e-3


@torch.no_grad()
def test_bn_reparametrization_advice_fixes_real_fp16():
    model, inputs, ref, report = _watched(models.bn_huge_var)
    (finding,) = report.findings_by("parameter")
    assert suggest_fix(report, finding).startswith("exact affine re-parametrization of bn")
    broken = _half(model, inputs)
    assert (broken - ref).abs().max() > 0.1  # running_var -> inf: the BN output is its bias
    fixed = copy.deepcopy(model)
    _reparametrize_bn(fixed.bn)
    assert (_half(fixed, inputs) - ref).abs().max() < 2e-2


def _decomposed_layer_norm_fp16(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm as an opset<17 ONNX graph computes it: every step stored in FP16."""
    x = x.half()
    mean = x.mean(-1, keepdim=True)
    dev = x - mean
    var = (dev * dev).mean(-1, keepdim=True)
    return (dev / torch.sqrt(var + eps)).float()


@torch.no_grad()
def test_layernorm_rescale_exponent_fixes_decomposed_fp16():
    model, inputs, _, report = _watched(models.layernorm_variance)
    (finding,) = report.findings_by("internal")
    k = rescale_exponent(finding.peak, power=2)
    assert f"rescale its input by 2^-{k}" in suggest_fix(report, finding)
    x = model.proj(*inputs)
    eps = model.norm.eps
    ref = F.layer_norm(x, x.shape[-1:], eps=eps)
    assert (_decomposed_layer_norm_fp16(x, eps) - ref).abs().max() > 0.5  # overflow is real
    scaled = _decomposed_layer_norm_fp16(x / 2.0**k, eps / 4.0**k)  # scale-invariant
    assert (scaled - ref).abs().max() < 1e-2


@torch.no_grad()
def test_pool_rescale_exponent_fixes_the_fp16_sum():
    model, inputs, _, report = _watched(models.avgpool_sum)
    (finding,) = report.findings_by("internal")
    k = rescale_exponent(finding.peak)
    assert f"rescale the input by 2^-{k}" in suggest_fix(report, finding)
    y = model.conv(*inputs).half()
    n = y.shape[-1] * y.shape[-2]
    assert torch.isinf(y.sum((-2, -1))).any()  # the FP16 sum overflows before the division
    mean = (y / 2.0**k).sum((-2, -1)) / n * 2.0**k
    torch.testing.assert_close(mean.float(), model.conv(*inputs).mean((-2, -1)), atol=0.05, rtol=0)


class _ScaledIsland(torch.nn.Module):
    """The advice's island, written out: FP32 on input·p, output·(1/p), back to FP16."""

    def __init__(self, module: torch.nn.Module, p: float):
        super().__init__()
        self.module, self.p = module, p

    def forward(self, x):
        return (self.module(x.float() * self.p) / self.p).to(x.dtype)


@torch.no_grad()
def test_gelu_island_inside_the_rescale_fixes_real_fp16():
    model, inputs, ref, report = _watched(models.gelu_span)
    (span,) = report.spans
    k = rescale_exponent(span.peak)
    p = 2.0**k
    fix = suggest_fix(report, span)
    assert fix.startswith(f"FP32 island around act (GELU), inside a rescale by 2^-{k}")
    assert f"undone by 2^{k} in fc2" in fix
    assert not torch.isfinite(_half(model, inputs)).all()
    fixed = copy.deepcopy(model)
    fixed.fc1.weight /= p
    fixed.fc1.bias /= p
    fixed.fc2.weight *= p
    fixed = fixed.half()
    fixed.act = _ScaledIsland(torch.nn.GELU(), p)  # no parameters: its FP32 math is exact
    out = fixed(*(x.half() for x in inputs)).float()
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 1e-2 * ref.abs().max()
