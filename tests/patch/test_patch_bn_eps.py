"""The stored form of a batch norm patch re-parametrizes into its exact affine form.

A state_dict holds a batch norm's statistics and weights but not its eps, and torch 2.10
and 2.11 reject eps = 0 even in eval, so the form keeps the module's own eps: running_mean
0, running_var c^2 - eps rounded to FP32 (c = 1 for any eps <= 0.5), the weight times c,
so that FP32's var + eps is exactly c^2. These tests pin that it computes what the eps = 0
form (var 1) computes, bit for bit in FP32 and to FP16's own rounding in real FP16 and in
the FP16 ONNX graph, and that the patched state_dict loaded into the original class keeps
the fix.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fp16lens
from fp16lens.patch._rules import bn_affine_stats

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


@pytest.mark.parametrize("eps", [1e-5, 1e-3, 1.001e-3, 1e-12, 0.0, 0.1, 0.3, 0.5, 0.7, 3.0])
def test_stored_form_is_exact_in_fp32(eps):
    var, c = bn_affine_stats(eps)
    assert var >= 0 and c >= 1 and math.log2(c).is_integer()
    assert torch.tensor(var, dtype=torch.float32).item() == var  # stored as it is
    total = torch.tensor(var, dtype=torch.float32) + torch.tensor(eps, dtype=torch.float32)
    assert total.item() == c * c and torch.sqrt(total).item() == c
    # in FP16 the var rounds to FP16's grid: 1/sqrt(var + eps) stays within 2^-12 of 1/c
    half = torch.tensor(var, dtype=torch.float16).float() + eps
    assert abs(1 / math.sqrt(half.item()) - 1 / c) <= 2**-12 / c


@torch.no_grad()
def test_patched_bn_keeps_its_eps_and_runs_in_eval():
    model, patched, inputs = _patched_bn()
    bn = patched.bn
    assert bn.eps == model.bn.eps == 1e-5  # kept; the user's model is untouched
    var, c = bn_affine_stats(bn.eps)
    assert c == 1.0 and torch.equal(bn.running_var, torch.full_like(bn.running_var, var))
    assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
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
    # FP16's var rounds to 1: 1/sqrt(1 + eps) is 1 - 5e-6, which moves a value by at most
    # one FP16 step (the explicit affine map rounds twice: two)
    assert (new.float() - old.float()).abs().max() <= 2 * torch.finfo(torch.float16).eps * (
        old.float().abs().max()
    )


@torch.no_grad()
def test_new_form_equals_eps_zero_form_in_fp16_onnx(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import numpy_helper

    from fp16lens.verify._onnx import OnnxRunner, session

    model, patched, inputs = _patched_bn(after_relu=True)  # BN after relu: not folded into conv
    new = tmp_path / "new.onnx"
    fp16lens.export(patched, inputs, new, precision="fp16", exporter="torchscript")
    # the eps = 0 form: the same FP16 graph with epsilon 0 and var 1 (torch 2.10/2.11
    # cannot export it from a module any more)
    proto = onnx.load(str(new))
    (bn,) = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
    (eps,) = [a for a in bn.attribute if a.name == "epsilon"]
    assert eps.f == pytest.approx(model.bn.eps)  # the module's own eps, in the file
    eps.f = 0.0
    (var,) = [t for t in proto.graph.initializer if t.name == bn.input[4]]
    assert (numpy_helper.to_array(var) == 1).all()  # 1 - 1e-5 is 1 in FP16
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
    # forced FP16 storage (the onnx-fp16 backend), and ONNX Runtime's own FP16 kernels:
    # at most one FP16 step apart (1/sqrt(1 + eps))
    for got, ref in zip(outs["new"], outs["old"]):
        step = torch.finfo(torch.float16).eps * ref.float().abs().max()
        assert (got.float() - ref.float()).abs().max() <= step


@torch.no_grad()
def test_the_patched_state_dict_loads_into_the_original_class_with_the_fix():
    """The usual way to ship a PyTorch model: torch.save(patched.state_dict()), then
    load_state_dict into the original class. The batch norm's eps is not in the file, so
    the form must not need another one: the loaded model computes what the patched one
    does, bit for bit in FP32, and its real FP16 stays finite."""
    import io

    model, patched, inputs = _patched_bn()
    buffer = io.BytesIO()
    torch.save(patched.state_dict(), buffer)
    buffer.seek(0)
    loaded = copy.deepcopy(model)  # the user's class, its own eps
    loaded.load_state_dict(torch.load(buffer), strict=True)
    assert torch.equal(loaded(*inputs), patched(*inputs))
    torch.testing.assert_close(loaded(*inputs), model(*inputs), rtol=1e-5, atol=1e-3)
    ref = model(*inputs).flatten()

    def fp16_cosine(m) -> float:
        out = copy.deepcopy(m).half()(inputs[0].half()).float().flatten()
        return float(F.cosine_similarity(out, ref, dim=0)) if torch.isfinite(out).all() else 0.0

    assert fp16_cosine(model) < 0.99  # the problem: var 1e7 is inf in FP16, channels collapse
    assert fp16_cosine(loaded) > 0.9999
