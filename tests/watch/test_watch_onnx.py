"""scan() of an ONNX file: the same report as the PyTorch path, and the real FP16 run agrees.

Ground truth: for the exported test models, the PyTorch path (itself tested against
``.half()``) and a decomposed FP16 computation; for the published PP-OCRv4 detector, the
graph run with every constant and every stored tensor rounded to FP16 (verify's
``onnx-fp16`` rewrite, ``_round_outputs``) in ONNX Runtime.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import warnings

import numpy as np
import pytest
import torch

import fp16lens
from fp16lens._core import WatchError
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report import Report

import models

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def _export(model, inputs, path, opset, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, str(path), opset_version=opset, dynamo=False, **kw)
    return str(path)


@functools.cache
def seed_modules() -> frozenset[str]:
    """The seed model's module names (built on first use: it needs torchvision)."""
    return frozenset(n for n, _ in models.TextDetector().named_modules())


def _module(site: str) -> str:
    """TorchScript exporter node name /a/a.0/conv/Conv -> the module a.0.conv (the
    exporter's scoping, read back by fp16lens.export's naming)."""
    from fp16lens.export._naming import module_from_scoped_name

    return module_from_scoped_name(site, seed_modules())


def _torch_modules(report: Report, names: list[str]) -> list[str]:
    return [report.sites[n].module or n.partition(":")[0] for n in names]


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    model, (x,) = models.seed_case()
    # batch norms kept as nodes (no conv folding), so node and module map one to one
    path = _export(
        model,
        (x,),
        tmp_path_factory.mktemp("seed") / "seed.onnx",
        17,
        training=torch.onnx.TrainingMode.PRESERVE,
    )
    return model, x, path


def test_seed_case_same_span_and_findings_as_pytorch(seed):
    model, x, path = seed
    torch_report = fp16lens.scan(model, [x], progress=False)
    onnx_report = fp16lens.scan(path, [x], progress=False)
    assert len(onnx_report.spans) == len(torch_report.spans) == 1
    o, t = onnx_report.spans[0], torch_report.spans[0]
    assert _module(o.start) == "backbone.layer4.1.bn2" == t.start
    assert _module(o.end) == "neck.reduce_c5.1" == t.end
    # the same modules, the residual add named by its module either way
    assert [_module(s).replace("relu_1", "relu") for s in o.sites] == [
        "backbone.layer4.1.bn2",
        "backbone.layer4.1",
        "backbone.layer4.1.relu",
        "neck.reduce_c5.0",
        "neck.reduce_c5.1",
    ]
    assert _torch_modules(torch_report, t.sites) == [
        "backbone.layer4.1.bn2",
        "backbone.layer4.1",
        "backbone.layer4.1.relu",
        "neck.reduce_c5.0",
        "neck.reduce_c5.1",
    ]
    assert o.peak == pytest.approx(t.peak, rel=1e-5)
    kinds = lambda r: sorted((f.mechanism, f.kind) for f in r.findings)  # noqa: E731
    assert kinds(onnx_report) == kinds(torch_report)
    param = onnx_report.findings_by(Mechanism.PARAMETER)[0]
    assert param.tensor == "neck.reduce_c5.1.running_var"
    assert _module(param.site) == "neck.reduce_c5.1"
    site = onnx_report.sites[o.start]
    assert site.op == "BatchNormalization" and site.overflow > 0
    assert (o.start, o.sites[1]) in onnx_report.edges


def test_seed_report_round_trips_and_renders(seed, tmp_path):
    _, x, path = seed
    report = fp16lens.scan(path, [x, x * 0.5], progress=False)
    assert report.meta.batches == 2 and report.meta.model_class == "seed"
    again = Report.load(report.save(tmp_path / "r.json"))
    assert again == report and again.spans[0].start == report.spans[0].start
    text = report.save(tmp_path / "r.txt").read_text()
    assert "BatchNormalization" in text
    # the advice is the ONNX patch's plan: BN absorbs the scale, no FP32 island needed
    plan = fp16lens.patch.plan(path, report)
    (k,) = {
        round(math.log2(r.factor))
        for r in plan.regions
        if "/backbone/layer4/layer4.1/bn2/BatchNormalization" in r.entries
    }
    flat = " ".join(text.split())
    assert (
        f"patch: rescale by 2^-{k} (the peak" in flat
        and "/backbone/layer4/layer4.1/bn2/BatchNormalization" in flat
    )
    assert not plan.islands and "FP32 island" not in flat


def test_folded_export_starts_at_the_conv_that_holds_the_bn(tmp_path):
    model, (x,) = models.seed_case()
    report = fp16lens.scan(_export(model, (x,), tmp_path / "f.onnx", 17), [x], progress=False)
    (span,) = report.spans
    assert span.start == "/backbone/layer4/layer4.1/conv2/Conv"  # bn2 folded into it
    assert report.sites[span.start].op == "Conv"


def _decomposed_fp16_overflows(model, x) -> bool:
    """The LayerNorm's input, then mean, x-mean, square all in real FP16."""
    h = model.proj(x).half()
    d = h - h.mean(-1, keepdim=True)
    return bool(torch.isinf(d * d).any())


def test_layernorm_opset11_pow_span_and_opset17_internal(tmp_path):
    model, (x,) = models.layernorm_variance()
    assert _decomposed_fp16_overflows(model, x)
    torch_report = fp16lens.scan(model, [x], progress=False)
    (t,) = torch_report.findings_by(Mechanism.INTERNAL)
    r17 = fp16lens.scan(_export(model, (x,), tmp_path / "a.onnx", 17), [x], progress=False)
    (f17,) = r17.findings_by(Mechanism.INTERNAL)
    assert f17.kind == t.kind == FindingKind.NORM_VARIANCE
    assert f17.site == "/norm/LayerNormalization" and t.site == "norm"
    assert f17.peak == pytest.approx(t.peak, rel=1e-4)
    assert not r17.spans
    r11 = fp16lens.scan(_export(model, (x,), tmp_path / "b.onnx", 11), [x], progress=False)
    (span,) = r11.spans
    assert span.start == "/norm/Pow" and span.peak == pytest.approx(t.peak, rel=1e-4)
    assert r11.sites["/norm/Pow"].op == "Pow"
    (f11,) = r11.findings_by(Mechanism.OUTPUT)
    assert "decomposed norm" in f11.detail and "opset 17" in f11.detail


def test_clean_control_is_clean(tmp_path):
    model, (x,) = models.clean()
    path = _export(model, (x,), tmp_path / "c.onnx", 13)
    assert fp16lens.scan(model, [x], progress=False).clean
    report = fp16lens.scan(path, [x], progress=False)
    assert report.clean, report.findings
    assert len(report.sites) > 5 and report.edges


def test_mean_pool_sum_internal_finding(tmp_path):
    model, (x,) = models.avgpool_sum()
    with torch.no_grad():  # real FP16: the sum of the conv output overflows in half
        y = copy.deepcopy(model.conv).half()(x.half())
        assert torch.isinf(y.sum((-1, -2))).any()
    report = fp16lens.scan(_export(model, (x,), tmp_path / "m.onnx", 13), [x], progress=False)
    (f,) = report.findings_by(Mechanism.INTERNAL)
    assert f.kind == FindingKind.SUM_BEFORE_MEAN
    assert report.sites[f.site].op in ("GlobalAveragePool", "ReduceMean")


def test_inputs_by_name_position_and_errors(seed, tmp_path):
    _, x, path = seed
    by_pos = fp16lens.scan(path, [x.numpy().astype(np.float64)], progress=False)
    name = onnx.load(path).graph.input[0].name
    by_name = fp16lens.scan(path, [{name: x}], progress=False)
    assert by_pos.spans[0].peak == by_name.spans[0].peak
    big = fp16lens.scan(path, [{name: x * 1e5}], progress=False)
    (inp,) = [f for f in big.findings if f.mechanism == "input"]  # named by the graph
    assert inp.site == "input[0]" and f"model input 0 ({name}) holds" in inp.detail, inp
    with pytest.raises(WatchError, match="no array for input"):
        fp16lens.scan(path, [{"nope": x}], progress=False)
    with pytest.raises(WatchError, match="bare array"):
        fp16lens.scan(path, x.numpy(), progress=False)
    with pytest.raises(WatchError, match="does not exist"):
        fp16lens.scan(tmp_path / "missing.onnx", [x], progress=False)


def test_external_data_and_dynamic_shapes(tmp_path):
    model, (x,) = models.bn_huge_var()
    src = tmp_path / "src.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            str(src),
            opset_version=13,
            dynamo=False,
            training=torch.onnx.TrainingMode.PRESERVE,
            dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}},
            input_names=["x"],
        )
    proto = onnx.load(str(src))
    out = tmp_path / "ext" / "m.onnx"
    out.parent.mkdir()
    onnx.save(proto, str(out), save_as_external_data=True, location="m.data", size_threshold=0)
    assert os.path.exists(out.parent / "m.data")
    big = torch.rand(2, 3, 24, 20)
    report = fp16lens.scan(str(out), [x, big], progress=False)
    assert report.meta.input_shapes == [[[1, 3, 16, 16]], [[2, 3, 24, 20]]]
    (param,) = report.findings_by(Mechanism.PARAMETER)
    assert param.tensor == "bn.running_var" and param.kind == FindingKind.PARAM_OVERFLOW
    bare = onnx.load(str(out), load_external_data=False)
    with pytest.raises(WatchError, match="base_dir"):
        fp16lens.scan(bare, [x], progress=False)
    again = fp16lens.scan(bare, [x, big], progress=False, base_dir=out.parent)
    assert again.findings == report.findings


# ---- a published model: PaddleOCR's PP-OCRv4 detector as rapidocr-onnxruntime ships it -----


def _real_fp16(proto, x: np.ndarray, keep: str = "") -> np.ndarray:
    """Every float constant and every stored tensor rounded to FP16 (all but ``keep``, a
    Constant node's output: neither its value nor its storage is rounded)."""
    from onnx import numpy_helper

    from fp16lens.verify._onnx import session
    from fp16lens.verify._onnx_graph import _round_outputs, tensor_types

    types = {k: 10 for k, v in tensor_types(proto).items() if v == 1}
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    for node in m.graph.node:
        for a in node.attribute:
            if a.HasField("t") and a.t.data_type == 1 and node.output[0] != keep:
                with np.errstate(over="ignore"):
                    half = numpy_helper.to_array(a.t).astype(np.float16).astype(np.float32)
                a.t.CopyFrom(numpy_helper.from_array(half, a.t.name))
    nodes = []
    for node in m.graph.node:
        nodes.append(node)
        nodes.extend(_round_outputs(node, {k: v for k, v in types.items() if k != keep}))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return session(m).run(None, {"x": x.astype(np.float16).astype(np.float32)})[0]


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "raw-0-255"])
def test_ppocr_det_verdict_matches_real_fp16(normalized):
    import zoo_real

    from fp16lens.verify._onnx import session

    try:
        path, x = zoo_real.ppocr_det(normalized)
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    report = fp16lens.scan(path, [x], progress=False)
    proto = onnx.load(path)
    ref = session(proto).run(None, {"x": x})[0]
    half = _real_fp16(proto, x)
    assert not report.clean
    # the BN kept in the graph holds running_var 9.8e7: inf in FP16, the head goes dark
    (var,) = [
        f for f in report.findings_by(Mechanism.PARAMETER) if f.kind == FindingKind.PARAM_OVERFLOW
    ]
    assert var.tensor == "batch_norm_0.w_2" and var.peak > 9e7
    assert report.sites[var.site].op == "BatchNormalization"
    text = ref > 0.3
    assert text.mean() > 0.01  # FP32 finds the word
    assert (half > 0.3).mean() < 0.1 * text.mean()  # real FP16 loses it
    # that constant kept in range, real FP16 finds the word again: it was the cause
    if normalized:  # no activation leaves range: that constant alone is the cause
        assert not report.spans
        fixed = _real_fp16(proto, x, keep="batch_norm_0.w_2") > 0.3
        assert (fixed == text).all()
    else:  # raw pixels: a hardswish Mul (6.59e4 > 65520: inf in FP16) and the head's conv too
        starts = {s.start: s.peak for s in report.spans}
        assert starts.keys() == {"p2o.Mul.8", "p2o.Conv.61"} and starts["p2o.Mul.8"] > 65520
        assert not np.isfinite(_real_fp16(proto, x, keep="batch_norm_0.w_2")).all()


def test_cli_scans_an_onnx_file_with_named_npz(seed, tmp_path, capsys):
    from fp16lens.cli import main

    _, x, path = seed
    name = onnx.load(path).graph.input[0].name
    np.savez(tmp_path / "in.npz", **{name: x.numpy()})
    rc = main(
        [
            "scan",
            path,
            "--input",
            str(tmp_path / "in.npz"),
            "--save",
            str(tmp_path / "r.json"),
            "--no-progress",
        ]
    )
    assert rc == 0
    saved = Report.load(tmp_path / "r.json")
    assert saved == fp16lens.scan(path, [x], progress=False)
    assert saved.spans[0].start.endswith("bn2/BatchNormalization")
    assert (
        main(
            [
                "scan",
                path,
                "--input",
                str(tmp_path / "in.npz"),
                "--fail-on",
                "overflow",
                "--no-progress",
            ]
        )
        == 1
    )
    capsys.readouterr()
    assert (
        main(["patch", path, "--report", str(tmp_path / "r.json"), "-o", str(tmp_path / "p.pt")])
        == 2
    )
    assert (
        "saved as ONNX" in capsys.readouterr().err
    )  # patch reads it (tests/patch/test_patch_onnx.py)
