"""patch() on the shared models, judged by real FP16 on CPU (``copy.deepcopy(m).half()``)
or by explicit decomposed FP16 computations; the reports come from fp16lens.watch."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch

from fp16lens._core import PatchError
from fp16lens.patch import Fp32Island, get_plan, patch, plan, relative_error

from models import avgpool_sum, bn_huge_var, gated_sum, gelu_span, layernorm_variance, seed_case
from plant import cosine as _cosine
from plant import run_half as _half
from plant import watch_report as _report


@pytest.fixture(scope="module")
def seed():
    model, inputs = seed_case()
    report = _report(model, inputs)
    return model, inputs, report, patch(model, report)


def test_seed_fp32_outputs_equal_the_original(seed):
    model, inputs, _, patched = seed
    with torch.no_grad():
        assert relative_error(model(*inputs), patched(*inputs)) <= 1e-6


def test_seed_half_is_finite_and_matches_fp32(seed):
    model, inputs, _, patched = seed
    with torch.no_grad():
        want = model(*inputs)
    assert not torch.isfinite(_half(model, inputs)).all()  # the problem is real
    got = _half(patched, inputs)
    assert torch.isfinite(got).all()
    assert _cosine(want, got) >= 0.9999


def test_seed_plan_rescales_the_span_without_islands(seed):
    model, _, report, patched = seed
    the_plan = get_plan(patched)
    assert the_plan.fp32_modules == [] and the_plan.unresolved == []
    covered = {s for r in the_plan.regions for s in r.sites}
    assert set(report.spans[0].sites) - set(report.spans[0].ends) <= covered
    for r in the_plan.regions:
        assert r.factor == 2.0 ** round(torch.log2(torch.tensor(r.factor)).item())
        assert r.peak / r.factor < 65504 / 2
    assert list(dict(patched.state_dict())) == list(dict(model.state_dict()))  # same keys
    assert not any(isinstance(m, Fp32Island) for m in patched.modules())


def test_seed_exit_bn_with_huge_running_var_is_fp16_safe(seed):
    _, _, report, patched = seed
    assert any(f.site == "neck.reduce_c5.1" and f.mechanism == "parameter" for f in report.findings)
    for t in patched.neck.reduce_c5[1].state_dict().values():
        if t.is_floating_point():
            assert torch.isfinite(t.half()).all()


def test_seed_is_idempotent(seed):
    _, inputs, _, patched = seed
    again = _report(patched, inputs)
    assert again.spans == [] and not again.findings_by("parameter")
    second = plan(patched, again)
    assert not second.changes and not second.regions
    twice = patch(patched, again)
    assert all(
        torch.equal(a, b)
        for a, b in zip(twice.state_dict().values(), patched.state_dict().values())
    )


def _onnx_ops(model, inputs, path) -> Counter:
    onnx = pytest.importorskip("onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, str(path), dynamo=False, opset_version=17)
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


@pytest.fixture(scope="module")
def seed_ops(seed, tmp_path_factory) -> Counter:
    model, inputs, _, _ = seed
    return _onnx_ops(model, inputs, tmp_path_factory.mktemp("onnx") / "original.onnx")


def test_seed_onnx_export_adds_no_nodes(seed, seed_ops, tmp_path):
    _, inputs, _, patched = seed
    assert _onnx_ops(patched, inputs, tmp_path / "b.onnx") == seed_ops


def test_seed_without_extension_multiplies_the_outside_operand_once(seed, seed_ops, tmp_path):
    model, inputs, report, _ = seed
    patched = patch(model, report, extend=False)
    the_plan = get_plan(patched)
    [mul] = the_plan.multiplies
    assert (mul.site, mul.cut, mul.keep) == (
        "backbone.layer4.1:add",
        ("backbone.layer4.0.relu",),
        ("backbone.layer4.1.bn2",),
    )
    assert mul.factor == 1 / the_plan.regions[0].factor
    assert not any(s.startswith("backbone.layer4.0") for r in the_plan.regions for s in r.sites)
    assert list(patched.state_dict()) == list(model.state_dict())
    with torch.no_grad():
        want = model(*inputs)
        assert relative_error(want, patched(*inputs)) <= 1e-6
    got = _half(patched, inputs)
    assert torch.isfinite(got).all() and _cosine(want, got) >= 0.9999
    added = _onnx_ops(patched, inputs, tmp_path / "b.onnx") - seed_ops
    assert added["Mul"] == 1 and set(added) <= {"Mul", "Constant"}  # the scalar's Constant


def test_gate_operand_gets_a_multiply_where_the_region_cannot_grow():
    model, inputs = gated_sum()
    report = _report(model, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PatchError, match="inplace=False"):
        patch(model, report, inplace=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    patched = patch(model, report)
    [mul] = get_plan(patched).multiplies
    assert (mul.site, mul.owner, mul.cut) == (":add", "", (":sigmoid",))
    assert list(patched.state_dict()) == list(model.state_dict())
    with torch.no_grad():
        want = model(*inputs)
        assert relative_error(want, patched(*inputs)) <= 1e-6
    assert not torch.isfinite(_half(model, inputs)).all()  # the problem is real
    got = _half(patched, inputs)
    assert torch.isfinite(got).all() and _cosine(want, got) >= 0.9999
    assert _report(patched, inputs).spans == []


@pytest.mark.parametrize("after_relu", [False, True])
def test_bn_with_running_var_beyond_fp16_is_reparametrized(after_relu):
    model, inputs = bn_huge_var(after_relu)
    report = _report(model, inputs)
    patched = patch(model, report)
    the_plan = get_plan(patched)
    assert [(r.module, r.rule) for r in the_plan.reparametrized] == [("bn", "bn-affine")]
    # conv -> relu -> bn: the conv is untouched (no folding across the ReLU)
    assert torch.equal(patched.conv.weight, model.conv.weight)
    with torch.no_grad():
        want = model(*inputs)
        assert relative_error(want, patched(*inputs)) <= 1e-6
    assert _cosine(want, _half(model, inputs)) < 0.999  # the problem is real
    got = _half(patched, inputs)
    assert torch.isfinite(got).all() and _cosine(want, got) >= 0.9999


def _decomposed_fp16_layernorm(x: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm as an opset<17 FP16 graph runs it: every intermediate stored in half.
    Returns (output, variance)."""
    h = x.half()
    mean = h.mean(-1, keepdim=True)
    d = h - mean
    var = (d * d).mean(-1, keepdim=True)
    y = d / torch.sqrt(var + torch.tensor(norm.eps, dtype=torch.float16))
    return y * norm.weight.half() + norm.bias.half(), var


def _norm_input(model, inputs):
    seen = []
    handle = model.norm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        handle.remove()
    return seen[0]


def test_layernorm_variance_stays_finite_in_decomposed_fp16():
    model, inputs = layernorm_variance()
    report = _report(model, inputs)
    x = _norm_input(model, inputs)
    with torch.no_grad():
        want = model.norm(x)
        bad, bad_var = _decomposed_fp16_layernorm(x, model.norm)
        assert not torch.isfinite(bad_var).all()  # the problem: an inf variance zeroes the norm
        assert _cosine(want, bad.float()) < 0.5
        patched = patch(model, report)
        assert relative_error(model(*inputs), patched(*inputs)) <= 1e-6
        xp = _norm_input(patched, inputs)
        got, var = _decomposed_fp16_layernorm(xp, patched.norm)
        got = got.float()
    assert torch.isfinite(var).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
    assert _cosine(want, got) >= 0.9999


def test_sum_before_mean_fits_fp16_after_patch():
    model, inputs = avgpool_sum()
    report = _report(model, inputs)
    patched = patch(model, report)
    with torch.no_grad():
        before = model.conv(inputs[0]).half().sum((2, 3), dtype=torch.float16)
        after = patched.conv(inputs[0]).half().sum((2, 3), dtype=torch.float16)
        assert not torch.isfinite(before).all() and torch.isfinite(after).all()
        assert relative_error(model(*inputs), patched(*inputs)) <= 1e-6


def test_gelu_span_gets_a_minimal_fp32_island():
    model, inputs = gelu_span()
    report = _report(model, inputs)
    patched = patch(model, report)
    the_plan = get_plan(patched)
    assert the_plan.fp32_modules == ["act"]  # the GELU only, not fc1 or fc2
    assert isinstance(patched.act, Fp32Island)
    with torch.no_grad():
        want = model(*inputs)
        assert relative_error(want, patched(*inputs)) <= 1e-6
    assert not torch.isfinite(_half(model, inputs)).all()  # the problem is real
    half = copy.deepcopy(patched).half()
    assert half.fc1.weight.dtype == torch.float16
    got = _half(patched, inputs)
    assert torch.isfinite(got).all() and _cosine(want, got) >= 0.999
