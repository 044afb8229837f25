"""watch and patch on torch.fx GraphModules: symbolic_trace, torch.export(...).module()
and onnx2torch conversions, whose nodes carry numbers, None, kwargs and lists. Judged by
real FP16 on CPU (``copy.deepcopy(m).half()``), never by fp16lens itself."""

from __future__ import annotations

import copy
import importlib.util
import io
import warnings

import pytest
import torch
from torch import fx

import fp16lens
from fp16lens._core.compat import TORCH_VERSION
from fp16lens.patch import get_plan, patch, relative_error

from models import onnx_tiny, shape_args
from torchvision_compat import need_torchvision


def _report(model, inputs):
    with fp16lens.watch(model) as lens, torch.no_grad():
        out = model(*inputs)
    return lens.report, out


@torch.no_grad()
def _half(model, inputs):
    return copy.deepcopy(model).half()(*(a.half() for a in inputs)).float()


def _graph(kind: str, model, inputs):
    if kind == "symbolic_trace":
        return fx.symbolic_trace(model, concrete_args={"bias": None})
    if kind == "export":
        return torch.export.export(model, inputs).module()
    return model


def _onnx2torch(model, inputs, opset: int = 17):
    need_torchvision()  # onnx2torch imports torchvision
    onnx2torch = pytest.importorskip("onnx2torch")
    onnx = pytest.importorskip("onnx")
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, buf, opset_version=opset, dynamo=False)
    return onnx2torch.convert(onnx.load_from_string(buf.getvalue())).eval()


# open on torch 2.4: its fx and torch.export graphs name and order ops differently, and the
# planted span through them ends unresolved there (graph modules are tested from 2.5 on)
GRAPHS_FROM_2_5 = pytest.mark.skipif(
    TORCH_VERSION < (2, 5), reason="patching fx/torch.export graphs is tested from torch 2.5 on"
)


@GRAPHS_FROM_2_5
@pytest.mark.parametrize("kind", ["module", "symbolic_trace", "export"])
def test_graph_with_constants_kwargs_and_none_is_watched_and_patched(kind):
    model, inputs = shape_args()
    g = _graph(kind, model, inputs)
    report, out = _report(g, inputs)
    with torch.no_grad():
        want = g(*inputs)
    assert torch.equal(out, want)  # watch leaves outputs bit-identical
    assert not report.clean and not torch.isfinite(_half(g, inputs)).all()  # real FP16: inf/NaN
    patched = patch(g, report)
    the_plan = get_plan(patched)
    assert the_plan.unresolved == [] and the_plan.fp32_modules == []
    assert len(the_plan.multiplies) == 1  # relu(x) joins the rescaled add: one multiply
    with torch.no_grad():
        assert relative_error(want, patched(*inputs)) <= 1e-6
    assert torch.isfinite(_half(patched, inputs)).all()
    assert relative_error(want, _half(patched, inputs)) < 1e-2
    with torch.no_grad():
        assert torch.equal(g(*inputs), want)  # the user's graph is untouched


@GRAPHS_FROM_2_5
@pytest.mark.parametrize("kind", ["symbolic_trace", "export"])
def test_graph_functional_ops_are_named_by_their_fx_node(kind):
    model, inputs = shape_args()
    g = _graph(kind, model, inputs)
    report, _ = _report(g, inputs)
    nodes = {n.name for n in g.graph.nodes}
    functional = [s for s, st in report.sites.items() if st.kind == "op"]
    assert functional and all(s.startswith(":") for s in functional)
    assert {s[1:].partition("#")[0] for s in functional} <= nodes
    assert len(set(report.sites)) == len(report.sites)
    assert "<locals>" not in report.meta.model_class
    want = (
        "GraphModule (traced ShapeArgsNet)"
        if kind == "symbolic_trace"
        else "GraphModule (torch.export)"
    )
    assert report.meta.model_class == want
    with fp16lens.watch(g) as lens, torch.no_grad():  # names are stable across watches
        g(*inputs)
    assert list(lens.report.sites) == list(report.sites)


@GRAPHS_FROM_2_5
def test_graph_patch_inplace_edits_the_graph_module():
    model, inputs = shape_args()
    g = fx.symbolic_trace(model, concrete_args={"bias": None})
    report, want = _report(g, inputs)
    same = patch(g, report, inplace=True)
    assert same is g
    with torch.no_grad():
        assert relative_error(want, g(*inputs)) <= 1e-6
    assert torch.isfinite(_half(g, inputs)).all()


def test_onnx2torch_graph_with_planted_overflow_is_fixed():
    model, inputs = onnx_tiny()
    g = _onnx2torch(model, inputs)
    report, out = _report(g, inputs)
    with torch.no_grad():
        want = g(*inputs)
    assert torch.equal(out, want)
    assert report.meta.model_class == "GraphModule (converted from ONNX)"
    assert not report.clean and not torch.isfinite(_half(g, inputs)).all()
    patched = patch(g, report)
    assert get_plan(patched).unresolved == []
    with torch.no_grad():
        assert relative_error(want, patched(*inputs)) <= 1e-6
    got = _half(patched, inputs)
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0) > 0.999


def test_onnx2torch_clean_graph_gets_a_clean_verdict():
    model, inputs = onnx_tiny()
    with torch.no_grad():
        model.c1.weight.div_(1.0e6)
    g = _onnx2torch(model, inputs)
    report, _ = _report(g, inputs)
    assert torch.isfinite(_half(g, inputs)).all()
    assert report.clean


# ---- the published PP-OCRv4 text detector (rapidocr's wheel), through onnx2torch ------
def _ppocr_detector():
    onnx = pytest.importorskip("onnx")
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None:
        pytest.skip("needs rapidocr-onnxruntime (its wheel ships the PP-OCR ONNX models)")
    path = f"{spec.submodule_search_locations[0]}/models/ch_PP-OCRv4_det_infer.onnx"
    proto = onnx.load(path)
    # paddle2onnx stores weights as Constant nodes; onnx2torch reads initializers
    nodes = []
    for node in proto.graph.node:
        if node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"]:
            t = onnx.TensorProto()
            t.CopyFrom(node.attribute[0].t)
            t.name = node.output[0]
            proto.graph.initializer.append(t)
        else:
            nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    need_torchvision()
    return pytest.importorskip("onnx2torch").convert(proto).eval()


def _text_image() -> torch.Tensor:
    """scikit-image's bundled photo of text (offline), 64x128 RGB, pixels 0-255."""
    data = pytest.importorskip("skimage.data")
    img = torch.from_numpy(data.text()).float()[None, None]  # 172x448 grey
    img = torch.nn.functional.interpolate(img, size=(86, 224), mode="area")[:, :, 11:75, 48:176]
    return img.expand(1, 3, -1, -1).contiguous()


@pytest.fixture(scope="module")
def ppocr():
    return _ppocr_detector()


@pytest.mark.slow
@pytest.mark.parametrize("pixels", ["normalized", "raw 0-255"])
def test_ppocr_detector_verdict_matches_real_fp16_and_patch_fixes_it(ppocr, pixels):
    raw = _text_image()
    x = raw if pixels == "raw 0-255" else (raw / 255 - 0.5) / 0.5  # PP-OCR's mean/std 0.5
    report, out = _report(ppocr, (x,))
    with torch.no_grad():
        want = ppocr(x)
    assert torch.equal(out, want)
    half_model = copy.deepcopy(ppocr).half()
    inf_buffers = {
        name.rpartition(".")[0]
        for name, b in half_model.named_buffers()
        if not torch.isfinite(b).all()
    }
    found = {f.site for f in report.findings if f.mechanism == "parameter"}
    assert inf_buffers and found == inf_buffers  # the BN running_var that .half() makes inf
    assert not report.clean
    patched = patch(ppocr, report)
    with torch.no_grad():
        assert relative_error(want, patched(x)) <= 1e-5  # the affine BN form rounds once
        before = half_model(x.half()).float()
    after = _half(patched, (x,))
    assert not any(not torch.isfinite(b).all() for b in copy.deepcopy(patched).half().buffers())
    err_before, err_after = ((h - want).abs().mean().item() for h in (before, after))
    print(
        f"{pixels}: mean |FP16 - FP32| {err_before:.3g} -> {err_after:.3g} after patch, "
        f"text-mask (p > 0.3) disagreement {_disagree(before, want):.3g} -> {_disagree(after, want):.3g}"
    )
    assert err_after <= err_before and err_after < 1e-2
    assert _disagree(after, want) <= _disagree(before, want) and _disagree(after, want) < 0.01
    # the journey most users take: the patched state_dict into the converted graph as it
    # was (the batch norms keep their own eps, so it is the patched model, bit for bit)
    loaded = copy.deepcopy(ppocr)
    loaded.load_state_dict(copy.deepcopy(patched.state_dict()), strict=True)
    with torch.no_grad():
        assert torch.equal(loaded(x), patched(x))
    assert torch.equal(_half(loaded, (x,)), after)


def _disagree(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of pixels whose text mask at PP-OCR's threshold 0.3 differs."""
    return ((a > 0.3) != (b > 0.3)).float().mean().item()
