"""ddddocr's shipped ONNX models (the ddddocr 1.6.1 wheel; ddddocr itself is not imported)
on real inputs, as ddddocr feeds them and as users get them wrong:

- ``common.onnx``, its OCR (a conv backbone with SiLU, an LSTM, 8210 classes per frame):
  a rendered line and a photograph strip, grey, 64 pixels high, divided by 255 as
  ddddocr does or left 0-255; and divided by 255 once too few (0-65025);
- ``common_old.onnx``, its older OCR (``DdddOcr(old=True)``): dynamically quantized
  (ConvInteger, int32 bias adds cast to float), all NaN in real FP16 on every input;
- ``common_det.onnx``, its YOLOX text detector, fed raw 0-255 pixels at 416x416 as
  ddddocr does.

Ground truth without fp16lens: the FP32 graph with real FP16 storage
(``zoo_real.onnx_real_fp16``); for a fixed model, the FP16 file fp16lens exports, run by
ONNX Runtime (FP16 tensors between its nodes), on inputs the patch never saw."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402

import fp16lens  # noqa: E402


def _model(name: str) -> str:
    return zoo_real.or_skip(zoo_real.ddddocr_model, name)


def _line(kind: str, text: str = zoo_real.SENTENCE) -> np.ndarray:
    """``/255`` as ddddocr feeds it, ``raw`` 0-255, ``x255`` 0-65025 (255 too much)."""
    photo = "astronaut" if text == "photo" else None
    x = zoo_real.ddddocr_line(kind != "/255", text if photo is None else "", photo)
    return x * 255 if kind == "x255" else x


def _run(path: str, x: np.ndarray) -> np.ndarray:
    """One ONNX Runtime run, the input in the file's own type (FP16 for an FP16 export)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the OCR's declared output shape is not its real one
    sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    (inp,) = sess.get_inputs()
    x = x.astype(np.float16 if inp.type == "tensor(float16)" else np.float32)
    return sess.run(None, {inp.name: x})[0].astype(np.float32)


def _same_text(ref: np.ndarray, got: np.ndarray) -> tuple[bool, float]:
    """(whether the decoded text is FP32's, cosine of the logits: NaN if not finite)."""
    if not np.isfinite(got).all():
        return False, float("nan")
    a, b = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    same = zoo_real.ddddocr_ids(ref) == zoo_real.ddddocr_ids(got)
    return same, float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _scan(path: str, feed: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ONNX Runtime's shape warnings
        return fp16lens.scan(path, [feed], progress=False)


@pytest.mark.parametrize(
    "kind, text",
    [("/255", zoo_real.SENTENCE), ("raw", zoo_real.SENTENCE), ("/255", "photo"), ("raw", "photo")],
    ids=["line", "line-raw", "photo", "photo-raw"],
)
def test_ocr_clean_in_real_fp16_gets_a_clean_verdict(kind, text):
    path = _model("common.onnx")
    x = _line(kind, text)
    (out16,) = zoo_real.onnx_real_fp16(path, {"input1": x}).values()
    same, cos = _same_text(_run(path, x), out16)
    assert same and cos >= 0.999  # ground truth: real FP16 reads the same text
    report = _scan(path, {"input1": x})
    assert report.clean and report.spans == [], [f.site for f in report.findings]


def test_ocr_fed_255_times_too_much_is_found_and_the_exported_fix_reads_other_lines():
    """0-65025 pixels: real FP16 reads garbage (finite: the overflow returns through a
    sigmoid); the scan finds the span, patch proves its fix on one line, and the FP16 file
    fp16lens exports keeps parity on a line and a photograph it never saw (cosine 0.999;
    FP16's 11 bits can flip a near-tie frame)."""
    path = _model("common.onnx")
    x = _line("x255")
    (out16,) = zoo_real.onnx_real_fp16(path, {"input1": x}).values()
    same, cos = _same_text(_run(path, x), out16)
    assert not same and cos < 0.5  # ground truth: the original in real FP16 reads garbage
    report = _scan(path, {"input1": x})
    assert not report.clean and report.spans
    held_out = [_line("x255", "Another line, 42"), _line("x255", "photo")]
    _fixed_reads_held_out(path, [x], held_out, text=False)


def _fixed_reads_held_out(path: str, batches: list, held_out: list, text: bool = True) -> None:
    """patch proven on ``batches`` (no PatchWarning), its FP16 export reading each batch and
    each held-out input as FP32 reads it (``text``: the same decoded text; else finite
    within cosine 0.999, patch's parity)."""
    import tempfile

    feeds = [{"input1": x} for x in batches]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ONNX Runtime's shape warnings
        report = fp16lens.scan(path, feeds, progress=False)
        warnings.simplefilter("error", fp16lens.PatchWarning)  # proven: nothing to warn
        fp16lens.patch(path, report, batches=feeds, out=f"{tmp}/fixed.onnx")
        art = fp16lens.export(f"{tmp}/fixed.onnx", None, f"{tmp}/fixed16.onnx")
        for y in [*batches, *held_out]:
            (real16,) = zoo_real.onnx_fp16_file_real(str(art.path), {"input1": y}).values()
            same, cos = _same_text(_run(path, y), real16)
            assert (same or not text) and cos >= 0.999, (same, cos)


@pytest.mark.parametrize("kind", ["/255", "raw"])
def test_quantized_ocr_all_nan_in_real_fp16_is_found(kind):
    """``common_old.onnx``'s int32 bias adds, cast to float, pass 65504 (7e4 to 1e5) on
    every input, on other layers for other inputs: real FP16 is NaN, the verdict is not
    clean and the first NaN is where a span starts."""
    path = _model("common_old.onnx")
    for x in [_line(kind), _line(kind, "photo")]:
        _, first = zoo_real.onnx_fp16_truth(path, {"input1": x})
        assert first is not None  # ground truth: real FP16 is not finite
        report = _scan(path, {"input1": x})
        assert not report.clean and first in [s.start for s in report.spans], first


def test_quantized_ocr_fixed_on_two_inputs_reads_two_others_as_fp32():
    """As ddddocr feeds it (divided by 255): patch proves its fix on a line and a photograph
    strip, and the exported FP16 file reads two lines it never saw as FP32 does. (On raw
    0-255 pixels the proof fails and says why: the next test.)"""
    path = _model("common_old.onnx")
    cal = [_line("/255"), _line("/255", "photo")]
    _fixed_reads_held_out(path, cal, [_line("/255", "Another line, 42"), _line("/255", "Fix it")])


def test_quantized_ocr_on_raw_pixels_names_the_quantizers_no_fp16_run_passes():
    """On raw 0-255 pixels, with every span kept FP32, real FP16 is finite but short of
    cosine 0.999. Ground truth without fp16lens: the FP32 graph with only the inputs of its
    DynamicQuantizeLinear nodes stored in FP16 reads other text already (cosine 0.992):
    each quantizer turns a rounding of its input into a whole INT8 step. patch names those
    ops and that cosine, advises FP32, and the tolerance it names is then proven."""
    import re

    path = _model("common_old.onnx")
    feed = {"input1": _line("raw")}
    (truth,) = zoo_real.onnx_rounded_before(path, feed, "DynamicQuantizeLinear")
    same, inherent = _same_text(_run(path, feed["input1"]), truth)
    assert not same and inherent < 0.995  # ground truth: no FP16 run reads this line
    report = _scan(path, feed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16lens.patch(path, report, batches=[feed])
    said = " ".join(str(w.message) for w in caught if w.category is fp16lens.PatchWarning)
    found = re.search(r"step ops \(22 DynamicQuantizeLinear, .*gives cosine ([0-9.]+)", said)
    assert found and float(found[1]) == pytest.approx(inherent, abs=1e-3), said
    assert "run the graph in FP32" in said and "graph is not FP16-safe" not in said
    tolerance = re.search(r"min_cosine=([0-9.]+)\) accepts", said)[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ONNX Runtime's shape warnings
        warnings.simplefilter("error", fp16lens.PatchWarning)  # proven: nothing to warn
        fp16lens.patch(path, report, batches=[feed], min_cosine=float(tolerance))


@pytest.mark.parametrize("source", ["page", "line"])
def test_text_detector_on_raw_pixels_is_clean_as_real_fp16(source):
    """As ddddocr feeds it: raw 0-255 pixels on a 416x416 canvas of grey 114."""
    path = _model("common_det.onnx")
    img = zoo_real.image("page", (416, 416)) if source == "page" else zoo_real.sentence_image()
    img = img.expand(1, 3, -1, -1).numpy()[..., :416, :416]
    x = np.full((1, 3, 416, 416), 114, np.float32)
    x[..., : img.shape[2], : img.shape[3]] = img
    ref = _run(path, x)
    (out16,) = zoo_real.onnx_real_fp16(path, {"images": x}).values()
    boxes32, boxes16 = ref[0, :, 4] * ref[0, :, 5] > 0.3, out16[0, :, 4] * out16[0, :, 5] > 0.3
    iou = (boxes32 & boxes16).sum() / max((boxes32 | boxes16).sum(), 1)
    assert boxes32.sum() > 20 and iou >= 0.98  # ground truth: the same boxes, near ties aside
    assert _same_text(ref, out16)[1] >= 0.9999
    report = _scan(path, {"images": x})
    assert report.clean and report.spans == [], [f.site for f in report.findings]


def test_cli_scan_says_how_to_see_the_spans_it_hides(tmp_path, capsys):
    """From a terminal: the quantized OCR has 11 spans, the view shows the top 10 and names
    the command that shows the rest (not the Python call), and that command shows it."""
    from fp16lens.cli import main

    path = _model("common_old.onnx")
    np.savez(tmp_path / "line.npz", input1=_line("/255"))
    report = tmp_path / "r.json"
    args = ["scan", path, "--input", str(tmp_path / "line.npz"), "--no-progress"]
    assert main([*args, "--save", str(report)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Overflow spans (11)" in out and " 4. peak " not in out  # the lowest peak: hidden
    assert f"… 1 more span: fp16lens show {report} --full shows all" in out
    assert "report.print(" not in out
    assert main(["show", str(report), "--full"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " 4. peak " in out and "more span" not in out
