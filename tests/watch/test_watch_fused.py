"""watch() on fused ops: the fast paths of nn.MultiheadAttention and
nn.TransformerEncoderLayer (one aten op each in eval under no_grad) and
scaled_dot_product_attention. Ground truth: real FP16 on CPU (``.half()``), and explicit
FP16 computations of the steps a kernel stores (CPU half matmuls, as a decomposed graph)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fp16lens import watch
from fp16lens._core.compat import TORCH_VERSION
from fp16lens.watch import _fused_kernels, _internal

import models

FP16_MAX = 65504.0


def _watched(model, inputs):
    with torch.no_grad():
        plain = model(*inputs)
        with watch(model) as lens:
            seen = model(*inputs)
    assert torch.equal(plain, seen), "watch changed the model's output"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    return lens.report


def _real_fp16(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).half()(
            *(t.half() if t.is_floating_point() else t for t in inputs)
        )


def _half_attention_steps(attn: nn.MultiheadAttention, x: torch.Tensor) -> dict:
    """The values the fast-path kernel stores, computed by hand in FP16: the projection
    (no bias), q/k/v with bias and q / sqrt(head dim), then q k^T."""
    a, x = copy.deepcopy(attn).half(), x.half()
    h, e = a.num_heads, a.embed_dim // a.num_heads
    with torch.no_grad():
        proj = x @ a.in_proj_weight.t()
        q, k, _ = (
            (t.unflatten(-1, (h, e)).transpose(1, 2)) for t in (proj + a.in_proj_bias).chunk(3, -1)
        )
        q = q / math.sqrt(e)
        return {
            "in_proj": proj,
            "qkv": torch.stack([q, k]),
            "attention-scores": q @ k.transpose(-2, -1),
        }


def _scores_peak_fp32(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return float((q @ k.transpose(-2, -1)).abs().max() * scale)


def _attention_findings(report):
    return [f for f in report.findings if f.kind == "attention-scores"]


# ---- nn.TransformerEncoderLayer (the repro) and nn.MultiheadAttention ----------
@pytest.mark.parametrize("builder", ["encoder", "mha", "mha_padded"])
def test_fast_path_scores_overflow_is_a_span_at_the_attention(builder):
    model, inputs = {
        "encoder": lambda: models.encoder_fastpath(),
        "mha": lambda: models.mha_fastpath(),
        "mha_padded": lambda: models.mha_fastpath(padded=True),
    }[builder]()
    assert torch.isnan(_real_fp16(model, inputs)).any()  # ground truth: real FP16 fails
    attn = next(m for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    steps = _half_attention_steps(attn, inputs[0])
    assert torch.isfinite(steps["in_proj"]).all() and torch.isfinite(steps["qkv"]).all()
    assert torch.isinf(steps["attention-scores"]).any()  # the first stored inf

    report = _watched(model, inputs)
    prefix = "layer.self_attn" if builder == "encoder" else "attn"
    span = report.spans[0]
    assert span.start == f"{prefix}:attention-scores" and not span.fused
    assert span.end == f"{prefix}:softmax"
    # the peak is the FP32 maximum of the scores (every key, padded ones too: the kernel
    # computes q k^T before masking)
    a = copy.deepcopy(attn).float()
    with torch.no_grad():
        proj = inputs[0] @ a.in_proj_weight.t() + a.in_proj_bias
        q, k, _ = (t.unflatten(-1, (4, 16)).transpose(1, 2) for t in proj.chunk(3, -1))
        truth = _scores_peak_fp32(q, k, 0.25)
    assert span.peak == pytest.approx(truth, rel=1e-5)
    assert report.sites[f"{prefix}:in_proj"].absmax < FP16_MAX
    assert report.sites[f"{prefix}:softmax"].absmax <= 1.0


@pytest.mark.parametrize(("norm_first", "activation"), [(False, "relu"), (True, "gelu")])
def test_fused_encoder_layer_op_records_every_stored_step(norm_first, activation):
    model, inputs = models.encoder_fastpath(
        fused_op=True, norm_first=norm_first, activation=activation
    )
    real = _real_fp16(model, inputs)
    report = _watched(model, inputs)
    if norm_first:  # attention sees the normalized stream: real FP16 stays finite
        assert torch.isfinite(real).all() and report.spans == []
        # both norms see the large stream: decomposed, (x-mean)^2 overflows in FP16
        x = inputs[0].half()
        assert torch.isinf((x - x.mean(-1, keepdim=True)) ** 2).any()
        internal = {(f.site, f.kind) for f in report.findings if f.mechanism == "internal"}
        assert internal == {("layer.norm1", "norm-variance"), ("layer.norm2", "norm-variance")}
    else:
        assert torch.isnan(real).any()
        assert [s.start for s in report.spans] == ["layer.self_attn:attention-scores"]
    for site in (
        "layer.self_attn.out_proj",
        "layer:add",
        "layer:add#2",
        "layer.norm1",
        "layer.norm2",
        "layer.linear1",
        f"layer:{activation}",
        "layer.linear2",
    ):
        assert site in report.sites, site
    assert report.sites["layer.linear1"].op == "Linear"  # shown as the module it is
    assert report.sites["layer.self_attn.out_proj"].op == "NonDynamicallyQuantizableLinear"


def test_fused_encoder_layer_ffn_overflow_starts_at_linear1():
    model, inputs = models.encoder_fastpath(scale=1.0, fused_op=True)
    with torch.no_grad():
        model.layer.linear1.weight.mul_(1e5)
    half = copy.deepcopy(model).half()
    x = inputs[0].half()
    with torch.no_grad():
        assert not torch.isfinite(half(x)).all()  # ground truth: real FP16 fails
        # explicit FP16: attention and norm1 stay finite, linear1's output does not
        attn = half.layer.self_attn
        y = half.layer.norm1(x + attn(x, x, x, need_weights=False)[0])
        assert torch.isfinite(y).all() and torch.isinf(half.layer.linear1(y)).any()
    report = _watched(model, inputs)
    assert [s.start for s in report.spans] == ["layer.linear1"]
    assert report.sites["layer.self_attn:attention-scores"].absmax < FP16_MAX


def test_decomposition_reproduces_the_kernels_fp32_output():
    """What is checked is what the kernel computes: its FP32 steps give its output."""
    model, (x,) = models.encoder_fastpath(scale=1.0, fused_op=True)
    layer = model.layer
    func = torch.ops.aten._transformer_encoder_layer_fwd.default
    a = layer.self_attn
    args = (
        x,
        64,
        4,
        a.in_proj_weight,
        a.in_proj_bias,
        a.out_proj.weight,
        a.out_proj.bias,
        False,
        False,
        layer.norm1.eps,
        layer.norm1.weight,
        layer.norm1.bias,
        layer.norm2.weight,
        layer.norm2.bias,
        layer.linear1.weight,
        layer.linear1.bias,
        layer.linear2.weight,
        layer.linear2.bias,
    )
    with torch.no_grad():
        out = func(*args)
        steps = _fused_kernels.stored("transformer_encoder_layer_fwd", func, args, {})
        last_add = steps[-2].value
        torch.testing.assert_close(
            torch.layer_norm(
                last_add, (64,), layer.norm2.weight, layer.norm2.bias, layer.norm2.eps
            ),
            out,
        )
        mha = torch.ops.aten._native_multi_head_attention.default
        margs = (
            x,
            x,
            x,
            64,
            4,
            a.in_proj_weight,
            a.in_proj_bias,
            a.out_proj.weight,
            a.out_proj.bias,
        )
        ctx = _fused_kernels.stored("native_multi_head_attention", mha, margs, {})[-2].value
        torch.testing.assert_close(a.out_proj(ctx.transpose(1, 2).reshape(x.shape)), mha(*margs)[0])


# ---- scaled_dot_product_attention ---------------------------------------------------
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_scores_are_an_internal_risk(masked):
    model, inputs = models.sdpa_attention(masked=masked)
    # real FP16 on CPU: the fused kernel keeps the scores in FP32, the output is finite
    # (torch 2.4's CPU kernel stored them in FP16; TensorRT and flash attention do not)
    assert torch.isfinite(_real_fp16(model, inputs)).all() or TORCH_VERSION < (2, 5)
    # an explicit FP16 decomposition (MatMul, Softmax as in an unfused graph) overflows
    half = copy.deepcopy(model).half()
    with torch.no_grad():
        q, k, _ = half.qkv(inputs[0].half())
        s = math.sqrt(1 / math.sqrt(q.shape[-1]))
        scores = (q * s) @ (k * s).repeat_interleave(2, dim=1).transpose(-2, -1)
        assert torch.isinf(scores).any() and torch.isfinite(q).all() and torch.isfinite(k).all()
        q32, k32, _ = model.qkv(inputs[0])
    report = _watched(model, inputs)
    assert report.spans == []
    (f,) = _attention_findings(report)
    assert f.mechanism == "internal" and f.site.startswith(":scaled_dot_product")
    assert f.peak == pytest.approx(_scores_peak_fp32(q32, k32, 0.25), rel=1e-5)


def test_scores_peak_in_blocks_with_grouped_heads(monkeypatch):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, 9, 8, generator=g), torch.randn(2, 3, 11, 8, generator=g)
    truth = _scores_peak_fp32(q, k, 0.5)
    monkeypatch.setattr(_internal, "_SCORES_CHUNK", 7)  # several blocks of query rows
    assert float(_internal.scores_absmax(q, k, 0.5)) == pytest.approx(truth, rel=1e-6)
    q3, k3 = q[0], k[0].repeat_interleave(2, dim=0)  # 3-D, no grouping
    assert float(_internal.scores_absmax(q3, k3, 0.5)) == pytest.approx(
        float((q3 @ k3.transpose(-2, -1)).abs().max() * 0.5), rel=1e-6
    )


# ---- clean control ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "builder",
    [
        lambda: models.encoder_fastpath(scale=1.0),
        lambda: models.encoder_fastpath(scale=1.0, fused_op=True, norm_first=True),
        lambda: models.mha_fastpath(scale=1.0, padded=True),
        lambda: models.sdpa_attention(scale=1.0, masked=True),
        lambda: models.sdpa_attention(scale=1.0),
    ],
)
def test_clean_attention_gets_a_clean_verdict(builder):
    model, inputs = builder()
    assert torch.isfinite(_real_fp16(model, inputs)).all()
    report = _watched(model, inputs)
    assert report.spans == [] and [f for f in report.findings if f.mechanism == "internal"] == []
    assert any(":attention" in s or ":scaled_dot_product" in s for s in report.sites)
