"""Underflow that breaks, found and fixed in ONNX files: a small log(x² + 1e-10) graph and
basic-pitch (Spotify's note transcription; its wheel ships ``nmp.onnx``, whose front end
computes log(x² + 1e-10) on a CQT). On normalized audio FP16 flushes part of x² and the
eps to 0, Log gives -inf and every note activation is NaN.

Ground truth: ``zoo_real.onnx_real_fp16`` (the FP32 graph with every tensor stored in
FP16, in ONNX Runtime, built without fp16lens) for the model as shipped, and for the fix
the strongly typed FP16 file ``fp16lens.export`` writes, with its FP16 storage made real
(``zoo_real.onnx_fp16_file_real``: as it is, ONNX Runtime's CPU kernels compute most of
its FP16 ops in FP32 with no FP16 between them)."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402
from underflow_graphs import log_eps, pow_neg, quiet, reciprocal, softmax_by_hand, sqrt_div  # noqa: E402
from zoo_real import (  # noqa: E402
    BASIC_PITCH_IN,
    BASIC_PITCH_NOTE,
    onnx_fp16_file_real,
    onnx_real_fp16,
)

import fp16lens  # noqa: E402
from fp16lens.patch.onnx import fp32_nodes  # noqa: E402

SQUARE = "model_1/normalized_log_1/Square;model_1/normalized_log_1/Square"
LOG = "model_1/normalized_log_1/Log;model_1/normalized_log_1/Log"
ADD = "model_1/normalized_log_1/add;model_1/normalized_log_1/add"
# the CQT's magnitude before that square: |re|² + |im|² (Pow, Sum), its root, a move
MAGNITUDE = {
    "model_1/cq_t2010v2_1/Pow;model_1/cq_t2010v2_1/Pow;model_1/cq_t2010v2_1/Pow/y;"
    "model_1/cq_t2010v2_1/Pow/y",
    "model_1/cq_t2010v2_1/Sum;model_1/cq_t2010v2_1/Sum",
    "model_1/cq_t2010v2_1/Sqrt_1;model_1/cq_t2010v2_1/Sqrt_1",
    "model_1/cq_t2010v2_1/transpose_70;model_1/cq_t2010v2_1/transpose_70",
}


def _run(path: str, feed: dict) -> dict:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keeps every Cast
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def _first_nonfinite(path: str, feed: dict) -> str | None:
    """The first node, in graph order, whose output real FP16 makes non-finite."""
    order = [(n.name or n.output[0], o) for n in onnx.load(path).graph.node for o in n.output]
    got = onnx_real_fp16(path, feed, tuple(o for _, o in order))
    return next((n for n, o in order if o in got and not np.isfinite(got[o]).all()), None)


def _fix(path: str, report, tmp_path):
    """(patched file, its FP16 export)."""
    patched = tmp_path / "patched.onnx"
    fp16lens.patch(path, report, out=patched)
    art = fp16lens.export(str(patched), None, tmp_path / "fp16.onnx", precision="fp16")
    return patched, art.path


SMALL = [  # (graph, input, its FP32 islands)
    (log_eps, quiet, ["square", "add_eps", "log"]),
    (sqrt_div, quiet, ["square", "add_eps", "sqrt", "div"]),
    (reciprocal, quiet, ["square", "add_eps", "recip"]),
    (pow_neg, quiet, ["square", "add_eps", "rsqrt"]),
    (
        softmax_by_hand,
        lambda: np.random.default_rng(1).uniform(-40, -20, (4, 16)).astype(np.float32),
        ["exp", "sum", "div"],
    ),
]


@pytest.mark.parametrize(("build", "make_x", "island"), SMALL, ids=[c[0].__name__ for c in SMALL])
def test_small_graphs_patched_into_an_island_are_finite_in_fp16(build, make_x, island, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(build(), str(path))
    x = make_x()
    assert not np.isfinite(onnx_real_fp16(str(path), {"x": x})["y"]).all()  # broken as it is
    report = fp16lens.scan(str(path), [x], progress=False)
    patched, typed = _fix(str(path), report, tmp_path)
    assert sorted(fp32_nodes(onnx.load(str(patched)))) == sorted(island)  # order is not meaning
    ref = _run(path, {"x": x})["y"]
    assert np.array_equal(_run(patched, {"x": x})["y"], ref)  # FP32 unchanged
    out = onnx_fp16_file_real(str(typed), {"x": x})["y"]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(
        out.astype(np.float32), ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max()
    )


@pytest.fixture(scope="module")
def pitch():
    try:
        return zoo_real.basic_pitch_onnx()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))


def _notes(out: dict) -> np.ndarray:
    return np.asarray(out[BASIC_PITCH_NOTE], dtype=np.float32)


@pytest.mark.parametrize("kind", ["speech", "tone"])
def test_basic_pitch_underflow_found_and_fixed(pitch, kind, tmp_path):
    x = zoo_real.pitch_frame(kind)
    feed = {BASIC_PITCH_IN: x}
    ref = _notes(_run(pitch, feed))
    broken = _notes(onnx_real_fp16(pitch, feed))
    assert np.isnan(broken).all() and (ref > 0.5).sum() > 0  # real FP16: every output NaN
    assert _first_nonfinite(pitch, feed) == LOG
    report = fp16lens.scan(pitch, [x], progress=False)
    assert not report.clean and not report.spans  # nothing overflows: it is underflow
    plain = fp16lens.export(pitch, None, tmp_path / "plain16.onnx", precision="fp16")
    verdict = fp16lens.verify(pitch, plain.path, (x,), backend="onnx-fp16")
    assert not verdict and verdict.nonfinite  # verify fails it too: scan and verify agree
    (f,) = report.findings_by("underflow")
    assert f.site == LOG and f.tensor == SQUARE and f.kind == "flush-singular"
    assert "1e-10" in f.detail and ADD in f.detail and f.peak > 0.1
    (eps,) = [p for p in report.findings if p.site == ADD]
    assert eps.mechanism == "parameter" and "flush too" in eps.detail
    patched, typed = _fix(pitch, report, tmp_path)
    # the island starts where the flushes start: the CQT magnitude's first square
    assert set(fp32_nodes(onnx.load(str(patched)))) == {*MAGNITUDE, SQUARE, ADD, LOG}
    assert np.array_equal(_notes(_run(patched, feed)), ref)  # FP32 unchanged
    out = _notes(onnx_fp16_file_real(str(typed), feed))
    assert np.isfinite(out).all()
    agree = ((out > 0.5) == (ref > 0.5)).mean()
    assert agree >= 0.999, agree


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_basic_pitch_fix_proven_on_speech_reads_quiet_speech_and_another_speaker(pitch, tmp_path):
    """patch proves its fix on one spoken frame (no PatchWarning), and the FP16 file it
    exports, run with real FP16 storage, hears the same notes as FP32 in frames it never
    saw: the sentence 40 dB quieter and another speaker. An island from the last square
    on (the CQT magnitude kept in FP16, its flushed squares carried as zeros) left quiet
    speech at cosine 0.966 in real FP16."""
    import warnings

    feed = {BASIC_PITCH_IN: zoo_real.pitch_frame("speech")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp16lens.PatchWarning)  # proven: nothing to warn
        report = fp16lens.scan(pitch, [feed], progress=False)
        fp16lens.patch(pitch, report, batches=[feed], out=tmp_path / "patched.onnx")
    typed = fp16lens.export(str(tmp_path / "patched.onnx"), None, tmp_path / "fp16.onnx").path
    for kind in ("speech", "quiet", "speaker2"):
        held = {BASIC_PITCH_IN: zoo_real.pitch_frame(kind)}
        assert np.isnan(_notes(onnx_real_fp16(pitch, held))).all()  # broken as shipped
        ref, got = _run(pitch, held), onnx_fp16_file_real(str(typed), held)
        assert ((_notes(got) > 0.5) == (_notes(ref) > 0.5)).all(), kind
        assert min(_cosine(ref[k], got[k]) for k in ref) >= 0.999, kind


def test_basic_pitch_on_raw_int16_samples_overflows_first(pitch):
    """Raw int16 samples: the CQT's squares pass 65504 before anything flushes; the scan
    says overflow (a span), which real FP16 meets first."""
    x = zoo_real.pitch_frame("raw")
    report = fp16lens.scan(pitch, [x], progress=False)
    assert report.spans and not report.clean
    first = _first_nonfinite(pitch, {BASIC_PITCH_IN: x})
    assert first == report.spans[0].start


def test_basic_pitch_cli_scan_fails_on_any(pitch, tmp_path, capsys):
    from fp16lens.cli import main

    np.savez(tmp_path / "in.npz", **{BASIC_PITCH_IN: zoo_real.pitch_frame("speech")})
    argv = ["scan", pitch, "--input", str(tmp_path / "in.npz"), "--no-progress", "--fail-on"]
    assert main([*argv, "any"]) == 1
    assert main([*argv, "underflow"]) == 1
    assert "underflow" in capsys.readouterr().out.lower()
