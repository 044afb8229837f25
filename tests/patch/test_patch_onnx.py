"""patch() of an ONNX graph: the planner of the PyTorch path over the graph's nodes.

Ground truth for FP16 is a real FP16-storage run of the graph in ONNX Runtime (every
constant and every stored tensor rounded to FP16: verify's ``onnx-fp16`` rewrite, through
``plant.onnx_fp16_run``), or, for a LayerNormalization node whose (x-mean)^2 is internal,
the decomposed computation in real torch half. The FP32 side is ONNX Runtime on the
inputs the graph was scanned with.
"""

from __future__ import annotations

import functools
import json
import warnings

import numpy as np
import pytest
import torch

import fp16lens
from fp16lens._core import PatchError
from fp16lens.patch.onnx import FP32_NODES_KEY, fp32_nodes

import models
from plant import onnx_fp16_run

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def _export(model, x, path, opset, **kw) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), opset_version=opset, dynamo=False, **kw)
    return str(path)


def _run(proto, x, outputs=None):
    from fp16lens.verify._onnx import session

    if outputs:
        m = onnx.ModelProto()
        m.CopyFrom(proto)
        m.graph.output.extend(onnx.helper.make_tensor_value_info(o, 1, None) for o in outputs)
        proto = m
    return session(proto).run(None, {proto.graph.input[0].name: np.asarray(x)})


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(a).max())


def _checked(proto, original, x) -> None:
    """The checker's full check passes, and FP32 outputs match the original within 1e-6."""
    onnx.checker.check_model(proto, full_check=True)
    for a, b in zip(_run(original, x), _run(proto, x)):
        assert _rel(a, b) <= 1e-6


def _rules(plan, name=lambda s: s) -> set:
    return {(name(r.module), r.rule, r.s_in, r.s_out) for r in plan.reparametrized}


# ---- a decomposed and a fused LayerNorm: the same fix as the PyTorch path ---------------


@pytest.mark.parametrize("opset", [17, 11])
def test_layernorm_variance_same_fix_as_pytorch(opset, tmp_path):
    model, (x,) = models.layernorm_variance()
    want = fp16lens.plan(model, fp16lens.scan(model, [x], progress=False))
    path = _export(model, x, tmp_path / "ln.onnx", opset)
    report = fp16lens.scan(path, [x], progress=False)
    plan = fp16lens.plan(path, report)
    norm = "/norm/LayerNormalization" if opset == 17 else "/norm/Pow"  # the scan's site
    names = {"/proj/MatMul": "proj", norm: "norm"}
    assert (
        _rules(plan, names.get)
        == _rules(want)
        == {("proj", "linear", 1.0, 32.0), ("norm", "norm", 32.0, 1.0)}
    )
    assert [r.factor for r in plan.regions] == [r.factor for r in want.regions] == [32.0]
    original = onnx.load(path)
    fixed = fp16lens.patch(path, report)
    _checked(fixed, original, x)
    nodes = {n.name: n for n in fixed.graph.node}
    if opset == 17:  # epsilon / 32^2 on the node; its (x-mean)^2 in real FP16 now finite
        (eps,) = [a.f for a in nodes[norm].attribute if a.name == "epsilon"]
        assert eps == pytest.approx(1e-5 / 1024, rel=1e-6)
        for proto, overflows in ((original, True), (fixed, False)):
            (h,) = _run(proto, x, ["/proj/Add_output_0"])[1:]
            h = torch.from_numpy(h).half()
            d = h - h.mean(-1, keepdim=True)
            assert bool(torch.isinf(d * d).any()) == overflows
    else:  # the eps constant of the decomposed norm / 32^2; the stored Pow finite in FP16
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in fixed.graph.initializer}
        (got,) = [inits[i] for i in nodes["/norm/Add"].input if i in inits]  # was a Constant
        assert float(got) == pytest.approx(1e-5 / 1024, rel=1e-6)
        ref = _run(original, x)[0]
        before, after = (
            onnx_fp16_run(original, {"onnx::MatMul_0": x.numpy()})[0],
            onnx_fp16_run(fixed, {"onnx::MatMul_0": x.numpy()})[0],
        )
        assert _rel(ref, before) > 0.5  # (x-mean)^2 -> inf: the norm's output is 0
        assert _rel(ref, after) < 1e-2 and np.isfinite(after).all()


def test_shared_initializers_copied_for_the_rescaled_user_only(tmp_path):
    model, (x,) = models.shared_weight()  # one Linear on two paths, only the first rescaled
    path = _export(model, x, tmp_path / "sw.onnx", 11)
    report = fp16lens.scan(path, [x], progress=False)
    original, fixed = onnx.load(path), fp16lens.patch(path, report)
    (region,) = fp16lens.plan(path, report).regions
    assert region.sites == ("/fc/MatMul", "/fc/Add")
    before = {t.name: onnx.numpy_helper.to_array(t) for t in original.graph.initializer}
    after = {t.name: onnx.numpy_helper.to_array(t) for t in fixed.graph.initializer}
    assert all(np.array_equal(after[n], a) for n, a in before.items())  # shared: untouched
    old, new = ({n.name: list(n.input) for n in g.graph.node} for g in (original, fixed))
    for node in ("/fc/MatMul", "/fc/Add"):  # the rescaled path reads copies, divided by p
        (was,) = [t for t in old[node] if t in before]
        (copy,) = [t for t in new[node] if t in after and t not in before]
        assert np.array_equal(after[copy], before[was] / region.factor)
    assert old["/fc_1/MatMul"] == new["/fc_1/MatMul"] and old["/fc_1/Add"] == new["/fc_1/Add"]
    _checked(fixed, original, x)
    feed = {original.graph.input[0].name: x.numpy()}
    ref = _run(original, x)[0]
    assert _rel(ref, onnx_fp16_run(original, feed)[0]) > 0.1  # (x-mean)^2 -> inf
    assert _rel(ref, onnx_fp16_run(fixed, feed)[0]) < 1e-2


# ---- the seed case: BN overflow through a residual add into a neck BN with var 1.4e9 ----


@functools.cache
def _seed_names() -> frozenset[str]:
    return frozenset(n for n, _ in models.TextDetector().named_modules())


def _module(site: str) -> str:
    from fp16lens.export._naming import module_from_scoped_name

    return module_from_scoped_name(site, _seed_names())


@pytest.mark.parametrize("opset", [17, 11])
def test_seed_case_same_fix_as_pytorch_and_real_fp16_finite(opset, tmp_path):
    model, (x,) = models.seed_case()
    want = fp16lens.plan(model, fp16lens.scan(model, [x], progress=False))
    path = _export(
        model, x, tmp_path / "seed.onnx", opset, training=torch.onnx.TrainingMode.PRESERVE
    )
    report = fp16lens.scan(path, [x], progress=False)
    plan = fp16lens.plan(path, report)
    got = _rules(plan, _module)
    # PyTorch's BasicBlock calls one ReLU module twice, so its region also takes in bn1 and
    # conv2 of both blocks (one module, one scale); the graph has two Relu nodes
    reused = {
        (m, rule, s_in, s_out)
        for m, rule, s_in, s_out in _rules(want)
        if m.rsplit(".", 1)[-1] in ("bn1", "conv2")
    }
    assert got == _rules(want) - reused and len(got) == 6
    assert ("neck.reduce_c5.1", "bn-affine", 16.0, 1.0) in got
    assert (
        sorted(r.factor for r in plan.regions)
        == sorted(r.factor for r in want.regions)
        == [16.0, 32.0]
    )
    assert not plan.islands and not plan.unresolved
    original = onnx.load(path)
    fixed = fp16lens.patch(path, report)
    _checked(fixed, original, x)
    assert not fp32_nodes(fixed) and not any(p.key == FP32_NODES_KEY for p in fixed.metadata_props)
    # exporters share equal initializers through Identity nodes: the rescaled BNs got copies
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in fixed.graph.initializer}
    for t in original.graph.initializer:
        assert np.array_equal(inits[t.name], onnx.numpy_helper.to_array(t)) or any(
            _module(n.name) in {r[0] for r in got} for n in original.graph.node if t.name in n.input
        )
    feed = {original.graph.input[0].name: x.numpy()}
    ref = _run(original, x)[0]
    before, after = onnx_fp16_run(original, feed)[0], onnx_fp16_run(fixed, feed)[0]
    assert not np.isfinite(before).all()
    assert np.isfinite(after).all() and _rel(ref, after) < 2e-2


def test_join_operand_gets_one_exact_mul_without_extending(tmp_path):
    model, (x,) = models.seed_case()
    path = _export(model, x, tmp_path / "seed.onnx", 17, training=torch.onnx.TrainingMode.PRESERVE)
    report = fp16lens.scan(path, [x], progress=False)
    want = fp16lens.plan(model, fp16lens.scan(model, [x], progress=False), extend=False)
    fixed = fp16lens.patch(path, report, extend=False)
    plan = fp16lens.plan(path, report, extend=False)
    (mul,) = plan.multiplies  # the residual operand from layer4.0, as on the PyTorch path
    (torch_mul,) = want.multiplies
    assert (_module(mul.site), [_module(c).replace("relu_1", "relu") for c in mul.cut]) == (
        "backbone.layer4.1",
        list(torch_mul.cut),
    )
    (node,) = [n for n in fixed.graph.node if n.op_type == "Mul"]
    (factor,) = [
        onnx.numpy_helper.to_array(t) for t in fixed.graph.initializer if t.name == node.input[1]
    ]
    assert float(factor) == mul.factor and np.log2(mul.factor) == round(np.log2(mul.factor))
    original = onnx.load(path)
    _checked(fixed, original, x)
    after = onnx_fp16_run(fixed, {original.graph.input[0].name: x.numpy()})[0]
    assert np.isfinite(after).all() and _rel(_run(original, x)[0], after) < 2e-2


def test_fp32_island_named_in_metadata(tmp_path):
    model, (x,) = models.gelu_span()  # GELU at opset 17: Div, Erf, Add, Mul, Mul
    path = _export(model, x, tmp_path / "g.onnx", 17)
    report = fp16lens.scan(path, [x], progress=False)
    fixed = fp16lens.patch(path, report)
    plan = fp16lens.plan(path, report)
    (island,) = plan.islands  # x * (erf(x/sqrt2) + 1) carries x's scale; erf takes x back
    assert island.module == "/act/Erf" and island.in_scale == plan.regions[0].factor
    kept = fp32_nodes(fixed)
    assert json.loads(dict((p.key, p.value) for p in fixed.metadata_props)[FP32_NODES_KEY]) == kept
    (pre,) = [n for n in fixed.graph.node if n.name in kept and n.op_type == "Mul"]
    assert (
        kept == ["/act/Erf", pre.name]
        and pre.output[0] in {n.name: n for n in fixed.graph.node}["/act/Erf"].input
    )
    original = onnx.load(path)
    _checked(fixed, original, x)
    feed = {original.graph.input[0].name: x.numpy()}
    ref = _run(original, x)[0]
    assert not np.isfinite(onnx_fp16_run(original, feed)[0]).all()
    after = onnx_fp16_run(fixed, feed, kept)[0]
    assert np.isfinite(after).all() and _rel(ref, after) < 1e-2
    again = fp16lens.scan(fixed, [x], progress=False)  # the patched graph scans clean
    assert (
        again.clean
        and fp16lens.patch(fixed, again).SerializeToString() == fixed.SerializeToString()
    )


def test_clean_model_empty_plan_and_unchanged_graph(tmp_path):
    model, (x,) = models.clean()
    path = _export(model, x, tmp_path / "c.onnx", 13)
    report = fp16lens.scan(path, [x], progress=False)
    plan = fp16lens.plan(path, report)
    assert not plan.changes and not plan.regions and not plan.unresolved
    fixed = fp16lens.patch(path, report, out=tmp_path / "f.onnx")
    assert fixed.SerializeToString() == onnx.load(path).SerializeToString()
    assert onnx.load(str(tmp_path / "f.onnx")).SerializeToString() == fixed.SerializeToString()


def test_report_of_another_graph_is_refused(tmp_path):
    model, (x,) = models.layernorm_variance()
    report = fp16lens.scan(_export(model, x, tmp_path / "a.onnx", 11), [x], progress=False)
    other = _export(model, x, tmp_path / "b.onnx", 17)
    with pytest.raises(PatchError, match="report is from another model"):
        fp16lens.patch(other, report)
    with pytest.raises(PatchError, match="never patched in place"):
        fp16lens.patch(other, report, inplace=True)


def test_stale_report_refused(tmp_path):
    from fp16lens._core import StaleReportError

    model, (x,) = models.layernorm_variance()
    path = _export(model, x, tmp_path / "a.onnx", 17)
    report = fp16lens.scan(path, [x], progress=False)
    assert "proj.bias" in report.meta.weights  # the scan fingerprints the float initializers
    assert fp16lens.plan(path, report).regions  # the same weights: accepted
    proto = onnx.load(path)
    bias = next(t for t in proto.graph.initializer if t.name == "proj.bias")
    bias.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(bias) + 1, "proj.bias"))
    with pytest.raises(StaleReportError, match=r"proj\.bias"):
        fp16lens.patch(proto, report)


# ---- a published model: PP-OCRv4's detector with a BN of running_var 9.8e7 --------------


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "raw-0-255"])
def test_ppocr_det_patched_finds_the_word_in_real_fp16(normalized):
    import zoo_real

    try:
        path, x = zoo_real.ppocr_det(normalized)
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    report = fp16lens.scan(path, [x], progress=False)
    plan = fp16lens.plan(path, report)
    (bn,) = [r for r in plan.reparametrized if r.rule == "bn-affine"]
    assert report.sites[bn.module].op == "BatchNormalization"
    assert not plan.unresolved  # SE products x * gate(x) carry x's scale
    # raw pixels: hardswish's Clip(x + 3) sees x / 16 and runs as an FP32 island (Muls by 16)
    assert [(i.module, i.in_scale) for i in plan.islands] == (
        [] if normalized else [("p2o.Clip.2", 16.0)]
    )
    original = onnx.load(path)
    fixed = fp16lens.patch(path, report, batches=[{"x": x}])  # proven in FP16 on the page
    onnx.checker.check_model(fixed, full_check=True)
    kept = fp32_nodes(fixed)
    assert len(kept) == (0 if normalized else 2) and all(
        n.name for n in fixed.graph.node if n.name in kept
    )
    ref = _run(original, x)[0]
    assert _rel(ref, _run(fixed, x)[0]) < 1e-4  # the affine form rounds once in FP32
    text = ref > 0.3
    before = onnx_fp16_run(original, {"x": x})[0] > 0.3
    after = onnx_fp16_run(fixed, {"x": x}, kept)[0]
    assert text.mean() > 0.1 and (before != text).mean() > 0.1  # FP16 loses the word
    assert np.isfinite(after).all() and ((after > 0.3) != text).mean() < 0.005


def test_cli_patches_an_onnx_file(tmp_path, capsys):
    from fp16lens.cli import main

    model, (x,) = models.layernorm_variance()
    path = _export(model, x, tmp_path / "ln.onnx", 11)
    fp16lens.scan(path, [x], progress=False).save(tmp_path / "r.json")
    out = tmp_path / "fixed.onnx"
    assert main(["patch", path, "--report", str(tmp_path / "r.json"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "patched model saved to" in printed and "/norm/Pow" in printed
    _checked(onnx.load(str(out)), onnx.load(path), x)
    np.savez(tmp_path / "in.npz", **{onnx.load(path).graph.input[0].name: x.numpy()})
    assert (
        main(
            [
                "patch",
                path,
                "--report",
                str(tmp_path / "r.json"),
                "-o",
                str(out),
                "--json",
                "--input",
                str(tmp_path / "in.npz"),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["fixed"] is True
    assert (
        main(["patch", path, "--report", str(tmp_path / "r.json"), "-o", str(tmp_path / "p.pt")])
        == 2
    )
    assert "saved as ONNX" in capsys.readouterr().err


def test_nodes_inserted_before_one_node_come_after_those_they_read():
    """One island's output multiply and the next island's input multiply of that output,
    both inserted before the same node and made in the other order (the order of the
    plan's islands): the first one written reads what the second makes (magika's GELU
    island after its LayerNorm island, tests/patch/test_patch_onnx_magika.py)."""
    from onnx import helper

    from fp16lens.patch.onnx._apply import _ordered

    reads = helper.make_node("Mul", ["t", "k2"], ["u"], name="reads")
    makes = helper.make_node("Mul", ["t_inner", "k1"], ["t"], name="makes")
    apart = helper.make_node("Mul", ["x", "k3"], ["v"], name="apart")
    assert [n.name for n in _ordered([reads, apart, makes])] == ["apart", "makes", "reads"]
    assert [n.name for n in _ordered([apart, makes, reads])] == ["apart", "makes", "reads"]
