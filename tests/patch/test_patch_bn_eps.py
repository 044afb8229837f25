"""The stored form of a batch norm patch re-parametrizes into its exact affine form.

torch 2.10 and 2.11 reject eps = 0 even in eval, so the form is running_mean 0,
running_var 0.5, eps 0.5: sqrt(0.5 + 0.5) = 1 exactly in FP32 and FP16. These tests pin
that it computes what the old eps = 0 form (var 1) computed, in FP32, in real FP16 and in
the FP16 ONNX graph, bit for bit.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import fp16lens
from fp16lens._core.compat import BN_AFFINE_EPS, BN_AFFINE_VAR

import models


def _patched_bn(after_relu: bool = False):
    model, inputs = models.bn_huge_var(after_relu)
    with fp16lens.watch(model) as lens:
        model(*inputs)
    patched = fp16lens.patch(model, lens.report)
    assert [r.rule for r in patched._fp16lens_plan.reparametrized if r.module == "bn"] == [
        "bn-affine"
    ]
    return model, patched, inputs


def _eps_zero_form(patched):
    """The same patched model with the old stored form (var 1, eps 0)."""
    old = copy.deepcopy(patched)
    old.bn.running_var.fill_(1.0)
    old.bn.eps = 0.0
    return old


def _bn_eps_zero(bn, x):
    """What the old form computes: (x - 0) / sqrt(1 + 0) * w + b. Through the batch_norm
    kernel where this release still accepts eps = 0, else the affine map it reduces to."""
    try:
        return F.batch_norm(
            x, bn.running_mean, torch.ones_like(bn.running_var), bn.weight, bn.bias, False, 0.0, 0.0
        )
    except (ValueError, RuntimeError):  # torch 2.10/2.11: eps must be positive
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * bn.weight.view(shape) + bn.bias.view(shape)


def test_stored_form_is_exact_in_fp32_and_fp16():
    assert BN_AFFINE_EPS > 0 and BN_AFFINE_VAR > 0
    for dtype in (torch.float32, torch.float16, torch.float64):
        one = torch.tensor(BN_AFFINE_VAR, dtype=dtype) + torch.tensor(BN_AFFINE_EPS, dtype=dtype)
        assert torch.sqrt(one).item() == 1.0
        assert torch.tensor(BN_AFFINE_VAR, dtype=dtype).item() == BN_AFFINE_VAR


@torch.no_grad()
def test_patched_bn_has_positive_eps_and_runs_in_eval():
    model, patched, inputs = _patched_bn()
    bn = patched.bn
    assert bn.eps == BN_AFFINE_EPS > 0
    assert torch.equal(bn.running_var, torch.full_like(bn.running_var, BN_AFFINE_VAR))
    assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
    assert model.bn.eps == 1e-5  # the user's model is untouched
    torch.testing.assert_close(patched(*inputs), model(*inputs), rtol=1e-5, atol=1e-3)


@torch.no_grad()
def test_new_form_equals_eps_zero_form_in_fp32():
    _, patched, inputs = _patched_bn()
    x = patched.act(patched.conv(*inputs))
    new = patched.bn(x)
    old = _bn_eps_zero(patched.bn, x)
    # bit-identical through the kernel; the explicit map may differ by one rounding
    assert (new - old).abs().max() <= torch.finfo(torch.float32).eps * old.abs().max()


@torch.no_grad()
def test_new_form_equals_eps_zero_form_in_real_fp16():
    _, patched, inputs = _patched_bn()
    half = copy.deepcopy(patched).half()
    x = half.act(half.conv(inputs[0].half()))
    new = half.bn(x)
    assert new.dtype == torch.float16 and torch.isfinite(new).all()
    old = _bn_eps_zero(half.bn, x)
    with contextlib.suppress(ValueError):  # the old form's kernel, where accepted: bit-identical
        assert torch.equal(new, _eps_zero_form(half).bn(x))
    # FP16 BN rounds once from FP32 arithmetic; the explicit affine map rounds twice
    assert (new.float() - old.float()).abs().max() <= 2 * torch.finfo(torch.float16).eps * (
        old.float().abs().max()
    )


@torch.no_grad()
def test_new_form_equals_eps_zero_form_in_fp16_onnx(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import numpy_helper

    from fp16lens.verify._onnx import OnnxRunner, session

    _, patched, inputs = _patched_bn(after_relu=True)  # BN after relu: not folded into conv
    new = tmp_path / "new.onnx"
    fp16lens.export(patched, inputs, new, precision="fp16", exporter="torchscript")
    # the old form: the same FP16 graph with epsilon 0 and var 1 (torch 2.10/2.11 cannot
    # export it from a module any more)
    proto = onnx.load(str(new))
    (bn,) = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
    (eps,) = [a for a in bn.attribute if a.name == "epsilon"]
    assert eps.f == BN_AFFINE_EPS
    eps.f = 0.0
    (var,) = [t for t in proto.graph.initializer if t.name == bn.input[4]]
    assert (numpy_helper.to_array(var) == BN_AFFINE_VAR).all()
    var.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(var) * 0 + 1, var.name))
    old = tmp_path / "old.onnx"
    onnx.save(proto, str(old))
    outs = {}
    for path in (new, old):
        runner = OnnxRunner(path)
        sess = session(runner.proto)
        plain = sess.run(None, runner.feed(inputs, [i.name for i in sess.get_inputs()]))[0]
        outs[path.stem] = (runner.run(inputs)[0], torch.from_numpy(plain))
    assert torch.isfinite(outs["new"][0]).all()
    # forced FP16 storage (the onnx-fp16 backend), and ONNX Runtime's own FP16 kernels
    assert torch.equal(outs["new"][0], outs["old"][0])
    assert torch.equal(outs["new"][1], outs["old"][1])
