"""The rescaling algebra (fp16lens._core.algebra): each class's scaling law checked in FP32
on a tiny tensor, the tables, and the report's advice agreeing with patch's kinds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16lens import watch
from fp16lens._core.algebra import (
    KIND_CLASS,
    Kind,
    OpClass,
    choose_factor,
    module_kind,
    onnx_class,
    op_class,
    op_kind,
    rescale_exponent,
    type_kind,
)
from fp16lens.patch._graph import build_graph
from fp16lens.report._spanfix import _cls as report_class

import models

P = 2.0**5


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


# ---- the scaling laws, in FP32 ---------------------------------------------------------
HOMOGENEOUS_OPS = {
    "relu": F.relu,
    "leaky_relu": lambda t: F.leaky_relu(t, 0.1),
    "max_pool2d": lambda t: F.max_pool2d(t, 2),
    "avg_pool2d": lambda t: F.avg_pool2d(t, 2),
    "adaptive_avg_pool2d": lambda t: F.adaptive_avg_pool2d(t, 1),
    "upsample_nearest2d": lambda t: F.interpolate(t, scale_factor=2, mode="nearest"),
    "upsample_bilinear2d": lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"),
    "ZeroPad2d": nn.ZeroPad2d(1),
    "mean": lambda t: t.mean((2, 3)),
    "PixelShuffle": nn.PixelShuffle(2),
}


@pytest.mark.parametrize("name", sorted(HOMOGENEOUS_OPS))
def test_homogeneous_ops_pass_the_scale(name):
    x, f = _x(1, 4, 4, 4), HOMOGENEOUS_OPS[name]
    assert op_class(name) == OpClass.HOMOGENEOUS
    torch.testing.assert_close(f(P * x), P * f(x), rtol=1e-6, atol=0)


def test_a_join_passes_equal_scales_only():
    a, b = _x(8), _x(8) + 3
    assert op_kind("add", 2) == Kind.JOIN and op_kind("cat", 2) == Kind.JOIN
    torch.testing.assert_close(P * a + P * b, P * (a + b), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([P * a, P * b]), P * torch.cat([a, b]), rtol=0, atol=0)
    assert not torch.allclose(P * a + b, P * (a + b))  # one operand unscaled: not a join
    assert op_kind("add", 1) == Kind.OPAQUE  # x + constant: (Px + c) != P(x + c)
    assert not torch.allclose(P * a + 3, P * (a + 3))


def test_absorbing_entry_and_exit_fold_the_scale_into_parameters():
    conv = nn.Conv2d(3, 4, 3).eval()
    x, w, b = _x(1, 3, 6, 6), conv.weight.detach(), conv.bias.detach()
    y = F.conv2d(x, w, b)
    assert type_kind(nn.Conv2d) == Kind.LINEAR and op_class("Conv2d") == OpClass.ABSORBING
    torch.testing.assert_close(F.conv2d(x, w / P, b / P), y / P, rtol=1e-6, atol=0)  # entry
    torch.testing.assert_close(F.conv2d(x / P, w * P, b), y, rtol=1e-6, atol=1e-7)  # exit
    lin = nn.Linear(5, 3)
    z = _x(2, 5)
    torch.testing.assert_close(
        F.linear(z, lin.weight / P, lin.bias / P), lin(z) / P, rtol=1e-6, atol=0
    )


def test_batch_norm_absorbs_an_input_scale_in_its_statistics():
    bn = nn.BatchNorm2d(4).eval()
    bn.running_mean.copy_(_x(4))
    bn.running_var.copy_(_x(4).abs() + 0.5)
    x = _x(1, 4, 3, 3)
    assert module_kind(bn) == Kind.BN and op_class("BatchNorm2d") == OpClass.ABSORBING
    out = F.batch_norm(
        x / P, bn.running_mean / P, bn.running_var / P**2, bn.weight, bn.bias, eps=bn.eps / P**2
    )
    torch.testing.assert_close(out, bn(x), rtol=1e-5, atol=1e-6)
    assert module_kind(nn.BatchNorm2d(4, track_running_stats=False)) == Kind.BLOCK


INVARIANT_OPS = {
    "layer_norm": lambda t, eps: F.layer_norm(t, (8,), eps=eps),
    "group_norm": lambda t, eps: F.group_norm(t, 2, eps=eps),
    "instance_norm": lambda t, eps: F.instance_norm(t, eps=eps),
    "rms_norm": lambda t, eps: F.rms_norm(t, (8,), eps=eps),
}


@pytest.mark.parametrize("name", sorted(INVARIANT_OPS))
def test_invariant_ops_ignore_the_scale_with_eps_over_p_squared(name):
    x, f, eps = _x(2, 4, 8) * 1e-3, INVARIANT_OPS[name], 1e-5
    assert op_class(name) == OpClass.INVARIANT
    torch.testing.assert_close(f(x / P, eps / P**2), f(x, eps), rtol=1e-5, atol=1e-5)
    # eps matters at this magnitude: unchanged eps is not scale-invariant
    assert not torch.allclose(f(x / P, eps), f(x, eps), rtol=1e-3, atol=1e-3)


BLOCKING_OPS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu": F.gelu, "exp": torch.exp,
                "softmax": lambda t: t.softmax(-1), "mul": lambda t: t * t}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BLOCKING_OPS))
def test_blocking_ops_neither_pass_nor_ignore_the_scale(name):
    x, f = _x(16), BLOCKING_OPS[name]
    assert op_class(name) == OpClass.BLOCKING and op_kind(name, 1) == Kind.OPAQUE
    assert not torch.allclose(f(x / 4), f(x) / 4, rtol=1e-3)
    assert not torch.allclose(f(x / 4), f(x), rtol=1e-3)


# ---- tables ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op_type", "attrs", "cls"),
    [
        *[(t, None, OpClass.ABSORBING)
          for t in ("Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization")],
        *[(t, None, OpClass.HOMOGENEOUS)
          for t in ("Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalAveragePool",
                    "Reshape", "Transpose", "Slice", "Concat", "Flatten", "Squeeze",
                    "Unsqueeze", "Identity", "Dropout", "Add", "Sub")],
        *[(t, None, OpClass.INVARIANT)
          for t in ("LayerNormalization", "GroupNormalization", "InstanceNormalization")],
        *[(t, None, OpClass.BLOCKING)
          for t in ("Sigmoid", "Tanh", "Softmax", "Exp", "Mul", "Div", "Pow", "Erf", "Foo")],
        ("Resize", None, OpClass.HOMOGENEOUS),
        ("Resize", {"mode": b"linear"}, OpClass.HOMOGENEOUS),
        ("Resize", {"mode": "cubic"}, OpClass.BLOCKING),
        ("Pad", None, OpClass.HOMOGENEOUS),
        ("Pad", {"value": 0.0}, OpClass.HOMOGENEOUS),
        ("Pad", {"value": -1.0}, OpClass.BLOCKING),
        ("Pad", {"mode": "reflect"}, OpClass.BLOCKING),
    ],
)  # fmt: skip
def test_onnx_op_types(op_type, attrs, cls):
    assert onnx_class(op_type, attrs) == cls


def test_instance_refinements_only_patch_sees():
    assert module_kind(nn.ConstantPad2d(1, 0.0)) == Kind.HOMOG
    assert module_kind(nn.ConstantPad2d(1, -1.0)) == Kind.BLOCK
    assert op_class("ConstantPad2d") == OpClass.BLOCKING  # value unknown by name
    assert module_kind(nn.InstanceNorm2d(4, track_running_stats=True)) == Kind.BLOCK
    assert module_kind(nn.LayerNorm(4)) == Kind.NORM


def test_factor_and_exponent_land_the_peak_near_2_pow_13():
    k = rescale_exponent(271955.25)
    assert k == 6 and choose_factor([(271955.25, 1)], low=1.0, target=2.0**13) == 2.0**k


# ---- the report's advice and patch's kinds agree ------------------------------------------
def test_every_nn_module_name_has_the_class_of_its_type():
    for cls in vars(nn).values():
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls is not nn.Module:
            if cls.__name__.startswith("ConstantPad"):
                continue  # blocking by name (value unknown), see test_instance_refinements
            assert op_class(cls.__name__) == KIND_CLASS[type_kind(cls)], cls.__name__


AGREEMENT_CASES = {
    **models.WATCH_CASES,
    "relu_span": models.relu_span,
    "gated_sum": models.gated_sum,
    "block_mul": models.block_mul,
    "layernorm_on_input": models.layernorm_on_input,
    "attention_span": models.attention_span,
    "rmsnorm_square": models.rmsnorm_square,
    "random_chain": lambda: models.random_chain(["conv", "bn", "relu", "pool", "res"], boost=(1, 1e5)),
    "random_graph": lambda: models.random_graph(
        [(k, 1) for k in models.RandomGraph.KINDS], boost=(2, 1e5)),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(AGREEMENT_CASES))
def test_report_advice_and_patch_kinds_agree(case):
    """Per site of a real watched report: the class the report's advice uses is the class of
    the kind patch gives the site. The one context only patch sees: a functional conv/linear
    absorbs where its parameters are reachable (a GraphModule), else it is opaque; and a
    product or join fed by one tensor passes a scale where torch.fx shows patch that its
    other operand is a constant or a parameter (``x * gamma``, ``x + pos_embedding``),
    which the report cannot tell from ``x * x`` (it advises conservatively)."""
    model, inputs = AGREEMENT_CASES[case]()
    with torch.no_grad(), watch(model) as lens:
        model(*inputs)
    report = lens.report
    graph = build_graph(model, report)
    for site, st in report.sites.items():
        kind, advised = graph.kinds[site], report_class(report, site)
        if st.kind == "module":
            assert advised == KIND_CLASS[module_kind(graph.modules[site])], site
        if kind == Kind.OPAQUE and advised == OpClass.ABSORBING:
            assert st.kind != "module" and site not in graph.modules, site
            continue
        if advised == OpClass.BLOCKING and kind in (Kind.HOMOG, Kind.JOIN) and st.kind != "module":
            assert len(set(report.producers(site))) == 1, site  # only the one-tensor case
            continue
        assert advised == KIND_CLASS[kind], (site, st.op, kind)
