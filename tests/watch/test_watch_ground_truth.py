"""watch() against real FP16: the first op that produces inf in half precision on CPU is
the report's first span start; internal overflows match explicit decomposed FP16 math."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16lens import watch
from fp16lens._core.compat import TORCH_VERSION

import models


def _watched(builder, **kw):
    model, inputs = builder(**kw)
    with torch.no_grad(), watch(model) as lens:
        model(*inputs)
    return model, inputs, lens.report


def _site_of(model: nn.Module, module: str, aten_op: str) -> str:
    """Ground truth (module, aten op) -> site name, by the documented naming rule."""
    mod = model.get_submodule(module) if module else model
    builtin_leaf = type(mod).__module__.startswith("torch.nn.") and not list(mod.children())
    return module if builtin_leaf else f"{module}:{aten_op.rstrip('_')}"


@pytest.mark.parametrize("name", sorted(models.WATCH_CASES))
def test_first_span_start_is_first_inf_in_real_fp16(name):
    model, inputs, report = _watched(models.WATCH_CASES[name])
    truth = models.first_inf_site_fp16(model, inputs)
    if truth is None:
        assert report.spans == [], f"{name}: FP16 stays finite, but watch reports spans"
    else:
        assert report.spans, f"{name}: FP16 overflows at {truth}, watch saw no span"
        assert report.spans[0].start == _site_of(model, *truth)


def test_seed_case_span_runs_from_backbone_into_neck():
    _, _, report = _watched(models.seed_case)
    assert len(report.spans) == 1
    span = report.spans[0]
    assert span.start == "backbone.layer4.1.bn2"
    assert span.sites[:3] == [
        "backbone.layer4.1.bn2",
        "backbone.layer4.1:add",
        "backbone.layer4.1.relu",
    ]
    assert "neck.reduce_c5.0" in span.sites
    assert span.end == "neck.reduce_c5.1" and span.ends == ["neck.reduce_c5.1"]
    assert not span.reaches_output and not span.fused
    assert span.peak > 65504 and span.peak == report.sites[span.peak_site].absmax
    # the stages before layer4 and the other neck branches are in range
    assert report.sites["backbone.layer3.1.bn2"].absmax < 65504
    assert report.sites["neck.reduce_c4.0"].absmax < 65504


def test_functional_multiply_is_the_start():
    model, inputs, report = _watched(models.functional_mul)
    (span,) = report.spans
    assert span.start == ":mul" and span.end == ":div"
    x = model.fc(inputs[0]).detach()
    # neither operand of the multiply is out of range, the product is
    assert x.abs().max() < 65504 and torch.nn.functional.relu6(x + 3).abs().max() <= 6
    assert torch.isinf(x.half() * torch.nn.functional.relu6(x + 3).half()).any()
    assert span.peak == pytest.approx(
        float((x * torch.nn.functional.relu6(x + 3)).abs().max()), rel=1e-6
    )


def test_layernorm_variance_matches_decomposed_fp16():
    model, inputs, report = _watched(models.layernorm_variance)
    assert report.spans == []
    (f,) = report.findings_by("internal")
    assert (f.site, f.kind) == ("norm", "norm-variance")
    x = model.proj(inputs[0]).detach()
    h = x.half()
    dev = h - h.mean(-1, keepdim=True)
    assert torch.isinf(dev * dev).any(), "the decomposed FP16 square must overflow"
    assert torch.isfinite(model.norm(x)).all() and model.norm(x).abs().max() < 65504
    exact = ((x - x.mean(-1, keepdim=True)) ** 2).max()
    assert f.peak == pytest.approx(float(exact), rel=1e-5)


def test_average_pool_sum_overflows_in_decomposed_fp16():
    model, inputs, report = _watched(models.avgpool_sum)
    (f,) = report.findings_by("internal")
    assert (f.site, f.kind) == ("pool", "sum-before-mean")
    y = model.conv(inputs[0]).detach()
    assert torch.isinf(y.half().sum(dim=(-1, -2), dtype=torch.half)).any()
    assert torch.isfinite(y.half().mean(dim=(-1, -2))).all()
    assert f.peak == pytest.approx(float(y.sum(dim=(-1, -2)).abs().max()), rel=1e-4)


@pytest.mark.parametrize("after_relu", [False, True])
def test_batchnorm_running_var_beyond_fp16(after_relu):
    model, inputs, report = _watched(models.bn_huge_var, after_relu=after_relu)
    assert report.spans == []
    (f,) = report.findings_by("parameter")
    assert (f.site, f.tensor, f.kind, f.count) == ("bn", "running_var", "param-overflow", 8)
    half = copy.deepcopy(model).half()
    assert torch.isinf(half.bn.running_var).all()
    # FP16 silently replaces the BN output with its bias: no activation is ever inf
    out = half.bn(half.act(half.conv(inputs[0].half())))
    assert torch.isfinite(out).all()
    assert torch.equal(out, half.bn.bias.view(1, -1, 1, 1).expand_as(out))


def test_clean_model_has_no_findings():
    model, inputs, report = _watched(models.clean)
    assert report.clean and report.findings == [] and report.spans == []
    out = copy.deepcopy(model).half()(inputs[0].half())
    assert torch.isfinite(out).all()
    assert all(s.absmax < 65504 for s in report.sites.values())


def test_attention_scores_overflow_inside_fused_attention():
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q = torch.randn(1, 2, 8, 16) * 200
    k = torch.randn(1, 2, 8, 16) * 200
    v = torch.randn(1, 2, 8, 16)
    model = Attn()
    with torch.no_grad(), watch(model) as lens:
        model(q, k, v)
    (f,) = lens.report.findings_by("internal")
    assert f.kind == "attention-scores"
    # the unfused FP16 form (as exported to ONNX: q and k scaled by sqrt(scale), then
    # MatMul) overflows; PyTorch's fused FP16 kernel does not
    s = 16**-0.25
    scores = torch.matmul(q.half() * s, (k.half() * s).transpose(-2, -1))
    assert torch.isinf(scores).any()
    fused = F.scaled_dot_product_attention(q.half(), k.half(), v.half())
    # torch 2.4's CPU kernel stores the FP16 scores (NaN here); later releases do not
    assert torch.isfinite(fused).all() or TORCH_VERSION < (2, 5)
    assert f.peak == pytest.approx(float((q @ k.transpose(-2, -1)).abs().max() / 4), rel=1e-4)


def test_hf_style_mask_constant_is_a_note_not_a_span():
    class Masked(nn.Module):
        def forward(self, x, mask):
            bias = (1.0 - mask) * torch.finfo(torch.float32).min
            return torch.softmax(x + bias, -1)

    x, mask = torch.randn(2, 8), torch.ones(2, 8)
    mask[1, 4:] = 0
    model = Masked()
    with torch.no_grad(), watch(model) as lens:
        model(x, mask)
    r = lens.report
    assert r.spans == [] and r.clean
    assert r.findings and {(f.mechanism, f.kind) for f in r.findings} == {("note", "mask-constant")}

    # real FP16: a model cast with .half() uses finfo(float16).min and stays finite
    class MaskedHalf(nn.Module):
        def forward(self, x, mask):
            return torch.softmax(x + (1.0 - mask) * torch.finfo(x.dtype).min, -1)

    assert torch.isfinite(MaskedHalf()(x.half(), mask.half())).all()
