"""scan() of published ONNX models beyond the PP-OCRv4 detector (test_watch_onnx.py): the
PP-OCRv4 text recognizer as rapidocr-onnxruntime's wheel ships it (paddle2onnx, opset 12,
860 nodes, SVTR blocks with decomposed LayerNorms), on a word rendered with Pillow's
bundled font, read as the model was trained (``(pixels/255 - 0.5)/0.5``) and as raw 0-255
pixels (the user's mistake); and Silero VAD's ONNX files from the silero-vad wheel on the
spoken sentence, scaled to [-1, 1] and as raw int16 samples (the user's mistake).

Ground truth: the FP32 graph with real FP16 storage built in ``zoo_real.onnx_real_fp16``
(every constant, input and node output rounded to FP16 in ONNX Runtime, no fp16lens),
read by greedy CTC with the character list the file carries. The strongly typed FP16
file fp16lens exports is then checked with verify against the FP32 file.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens._core import PatchError  # noqa: E402
from fp16lens._core.sites import Mechanism  # noqa: E402
from fp16lens.report._advice import suggest_fix  # noqa: E402


def _shipped(build, *args):
    """A model file a wheel ships, or a skip naming the pip line."""
    try:
        return build(*args)
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def rec():
    return _shipped(zoo_real.rapidocr_model, "rec")


def _rec_truth(path: str, x: np.ndarray) -> tuple[np.ndarray, str | None]:
    got, first = zoo_real.onnx_fp16_truth(path, {"x": x})
    return got[onnx.load(path).graph.output[0].name], first


def _fp32(path: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def test_ppocr_rec_as_trained_is_clean_and_reads_the_word_in_fp16(rec, tmp_path):
    x = zoo_real.rec_input(raw=False)
    report = fp16lens.scan(rec, [x], progress=False)
    assert report.clean and not report.spans
    assert all(f.mechanism == Mechanism.NOTE for f in report.findings)
    out16, first = _rec_truth(rec, x)
    assert first is None and np.isfinite(out16).all()
    assert (
        zoo_real.rec_decode(rec, _fp32(rec, x)) == zoo_real.rec_decode(rec, out16) == zoo_real.SHORT
    )
    art = fp16lens.export(rec, None, tmp_path / "rec16.onnx")
    assert not art.fp32_nodes
    result = fp16lens.verify(rec, art.path, (x,))
    assert result and result.cosine > 0.9999


def test_ppocr_rec_on_raw_pixels_overflows_where_real_fp16_does(rec, tmp_path):
    x = zoo_real.rec_input(raw=True)
    report = fp16lens.scan(rec, [x], progress=False)
    out32 = _fp32(rec, x)
    out16, first = _rec_truth(rec, x)
    assert np.isfinite(out32).all() and not np.isfinite(out16).all()
    assert not report.clean
    span = report.spans[0]  # the earliest, as real FP16 meets it
    assert span.start == first == "p2o.Mul.110" and span.peak > 65504
    assert report.sites[span.start].op == "Mul"  # a hardswish x * relu6(x + 3)
    # raw pixels are a mistake in FP32 as well: the word is misread there too
    assert zoo_real.rec_decode(rec, out32) != zoo_real.SHORT
    result = fp16lens.verify(rec, fp16lens.export(rec, None, tmp_path / "rec16.onnx").path, (x,))
    assert not result and result.nonfinite


def test_ppocr_det_fp16_export_needs_its_huge_bn_variance_kept_fp32(tmp_path):
    """The first published model (the PP-OCRv4 detector, see test_watch_onnx.py): the scan's
    parameter finding names the BatchNormalization whose running variance (9.8e7) FP16
    cannot hold; the FP16 export refuses that weight, and with that one node kept FP32 the
    typed FP16 file finds the word as FP32 does."""
    try:
        path = zoo_real.rapidocr_model("det")
        img = zoo_real.sentence_image(zoo_real.SHORT, height=64).expand(1, 3, -1, -1).numpy()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    img = img[..., : img.shape[-1] // 32 * 32]
    mean = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
    std = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)
    x = np.ascontiguousarray((img / 255 - mean) / std, dtype=np.float32)
    report = fp16lens.scan(path, [x], progress=False)
    (var,) = [f for f in report.findings_by(Mechanism.PARAMETER) if f.kind == "param-overflow"]
    assert var.tensor == "batch_norm_0.w_2" and report.sites[var.site].op == "BatchNormalization"
    with pytest.raises(fp16lens.export.ExportError, match=f"batch_norm_0.w_2' of '{var.site}'"):
        fp16lens.export(path, None, tmp_path / "det16.onnx")
    art = fp16lens.export(path, None, tmp_path / "det16.onnx", fp32_nodes=[var.site])
    assert art.fp32_nodes == (var.site,)
    assert (_fp32(path, x) > 0.3).mean() > 0.01  # FP32 finds the word

    def text_iou(ref, got):  # the detector's task: its text mask (probability > 0.3)
        a, b = (next(iter(out.values())) > 0.3 for out in (ref, got))
        return float((a & b).sum() / (a | b).sum())

    result = fp16lens.verify(path, art.path, (x,), metric=text_iou)
    assert result and result.cosine > 0.9999 and result.metrics["text_iou"] > 0.99


# ---- Silero VAD as the silero-vad wheel ships it in ONNX -------------------------------


@pytest.fixture(scope="module")
def vad():
    return _shipped(zoo_real.silero_onnx)


def _vad_truth(path: str, feed: dict) -> tuple[float, str | None]:
    """(speech probability under real FP16 storage of the main graph, first inf node)."""
    got, first = zoo_real.onnx_fp16_truth(path, feed)
    return float(got["output"].ravel()[0]), first


def _vad_fp32(path: str, feed: dict) -> float:
    import onnxruntime as ort

    return float(
        ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feed)[0].ravel()[0]
    )


def test_silero_vad_onnx_as_expected_is_clean_and_keeps_its_probability(vad):
    feed = zoo_real.vad_feed(raw=False, chunk=5)  # 0.16 s in: speech
    report = fp16lens.scan(vad, [feed], progress=False)
    assert report.clean and not report.spans
    prob16, first = _vad_truth(vad, feed)
    assert first is None and _vad_fp32(vad, feed) > 0.5
    assert prob16 == pytest.approx(_vad_fp32(vad, feed), abs=0.01)


def test_silero_vad_onnx_fp16_export_keeps_its_if_bodies_fp32_and_verifies_as_real_fp16(
    vad, tmp_path
):
    """The FP16 file: STFT and encoder in FP16, the decoder's If bodies as written in FP32.
    verify passes on speech as the model expects it and fails on raw int16, where real FP16
    storage of the main graph misses the speech (the test above)."""
    art = fp16lens.export(vad, None, tmp_path / "vad16.onnx")
    ifs = [n.name for n in onnx.load(vad).graph.node if n.op_type == "If"]
    assert sorted(art.fp32_nodes) == sorted(ifs)
    assert fp16lens.verify(vad, art.path, [zoo_real.vad_feed(raw=False, chunk=5)])
    raw = fp16lens.verify(vad, art.path, [zoo_real.vad_feed(raw=True, chunk=5)])
    assert not raw and raw.first_divergence.startswith("/model/stft/")


def test_silero_vad_onnx_on_raw_int16_misses_speech_where_the_scan_says(vad):
    """Raw int16 samples: FP32 still hears the speech, real FP16 storage hears nothing (no
    inf reaches the output: the probability is just 0); the scan's first span is the STFT
    node where real FP16 first holds inf."""
    feed = zoo_real.vad_feed(raw=True, chunk=5)
    report = fp16lens.scan(vad, [feed], progress=False)
    prob16, first = _vad_truth(vad, feed)
    assert _vad_fp32(vad, feed) > 0.5 and prob16 < 0.01
    assert not report.clean
    span = report.spans[0]
    assert span.start == first and first.startswith("/model/stft/") and span.peak > 65504


@pytest.fixture(scope="module")
def vad_if():
    """silero_vad.onnx: the whole network inside If branches (8 and 16 kHz)."""
    return _shipped(zoo_real.silero_onnx, "silero_vad.onnx")


def _inlined(path: str, feed: dict, tmp_path) -> str:
    """The graph with every If replaced by the branch ``feed`` takes (fp16lens's inliner,
    a graph rewrite; its FP32 output is checked against the original's here), saved."""
    from fp16lens.watch.onnx._paths import Inliner
    from fp16lens.watch.onnx._run import ort_session

    _, model, _, _ = Inliner(onnx.load(path), lambda m: ort_session(m, "conditions")).resolve(feed)
    assert not [n for n in model.graph.node if n.op_type == "If"]
    out = str(tmp_path / "inlined.onnx")
    onnx.save(model, out)
    assert _vad_fp32(out, feed) == _vad_fp32(path, feed)
    return out


def test_silero_vad_onnx_inside_if_branches_on_raw_int16_overflows_where_real_fp16_does(
    vad_if, tmp_path
):
    """The scan inlines the branches the batch takes (sample rate 16 kHz: If_0's then
    branch, then the decoder's Ifs): raw int16 overflows at the STFT node where real FP16
    storage of the inlined graph first holds inf, the node the opset-15 file's test names."""
    feed = zoo_real.vad_feed(raw=True, chunk=5)
    report = fp16lens.scan(vad_if, [feed], progress=False)
    inlined = _inlined(vad_if, feed, tmp_path)
    prob16, first = _vad_truth(inlined, feed)
    assert _vad_fp32(vad_if, feed) > 0.5 and prob16 < 0.01
    assert not report.clean and len(report.sites) > 60
    span = report.spans[0]
    assert (
        span.start == first == "If_0/then/If_0_then_branch__Inline_0__/stft/Conv"
        and span.peak > 65504
    )
    assert (
        zoo_real.onnx_fp16_truth(zoo_real.silero_onnx(), feed)[1] == "/model/stft/Conv"
    )  # the opset-15 file
    assert not any(f.kind == "unscanned" for f in report.findings)
    [note] = [f for f in report.findings if "inlined" in f.detail]
    assert (
        note.mechanism == "note"
        and note.kind == "inlined-branch"
        and "If_0 (then, 1 batch)" in note.detail
    )
    advice = suggest_fix(report, span)  # what patch (which refuses it) and export really do
    assert "lies inside an If branch" in advice and "export keeps If nodes in FP32" in advice


def test_silero_vad_onnx_inside_if_branches_on_speech_is_clean(vad_if, tmp_path):
    """A clean model gets a clean verdict: speech scaled to [-1, 1], every branch seen."""
    feed = zoo_real.vad_feed(raw=False, chunk=5)
    report = fp16lens.scan(vad_if, [feed], progress=False)
    prob16, first = _vad_truth(_inlined(vad_if, feed, tmp_path), feed)
    assert first is None and prob16 == pytest.approx(_vad_fp32(vad_if, feed), abs=0.01)
    assert _vad_fp32(vad_if, feed) > 0.5
    assert report.clean and not report.spans and len(report.sites) > 60
    verdict = report.save(tmp_path / "report.txt").read_text().splitlines()[0]
    assert "is FP16-safe" in verdict


def test_silero_vad_onnx_patch_refuses_the_spans_inside_its_if(vad_if):
    """patch rewrites the main graph only: the raw-input spans lie in If_0's branch."""
    report = fp16lens.scan(vad_if, [zoo_real.vad_feed(raw=True, chunk=5)], progress=False)
    with pytest.raises(
        PatchError,
        match=r"/stft/Conv lie inside the If 'If_0'.*fp16lens.export keeps If nodes FP32",
    ):
        fp16lens.patch(vad_if, report)


# ---- the whole journey on a published ONNX file: scan, patch, export, verify ------------


def _mask_iou(ref, got) -> float:
    """The detector's task: agreement of its text masks (probability > 0.3)."""
    a, b = (
        np.asarray(next(iter(out.values())) if isinstance(out, dict) else out) > 0.3
        for out in (ref, got)
    )
    return float((a & b).sum() / max((a | b).sum(), 1))


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "raw-0-255"])
def test_ppocr_det_scan_patch_export_verify(normalized, tmp_path):
    """PP-OCRv4 det breaks in real FP16 (its BN variance 9.8e7, and on raw pixels a hardswish
    beyond 65504): fp16lens.patch on the scan's report, then the FP16 export of the patched
    file (its FP32 islands read from its metadata), finds the word as FP32 does."""
    import json

    try:
        path, x = zoo_real.ppocr_det(normalized)
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    ref = _fp32(path, x)
    (out16,) = zoo_real.onnx_real_fp16(path, {"x": x}).values()
    assert _mask_iou(ref, out16) < 0.5  # the original in real FP16 loses the word
    report = fp16lens.scan(path, [x], progress=False)
    patched = tmp_path / "patched.onnx"
    fp16lens.patch(path, report, out=patched)
    meta = {p.key: p.value for p in onnx.load(str(patched)).metadata_props}
    art = fp16lens.export(str(patched), None, tmp_path / "fixed16.onnx")
    assert set(json.loads(meta.get("fp16lens.fp32_nodes", "[]"))) <= set(art.fp32_nodes)
    result = fp16lens.verify(path, art.path, (x,), metric=_mask_iou)
    assert result and result.cosine > 0.9999 and result.metrics["_mask_iou"] > 0.99


def test_silero_vad_onnx_on_raw_int16_scan_patch_export_verify(vad, tmp_path):
    """Raw int16 samples, four chunks: real FP16 storage of the original hears nothing where
    FP32 hears speech; the patched file's FP16 export gives FP32's probabilities."""
    feeds = [zoo_real.vad_feed(raw=True, chunk=k) for k in (5, 10, 20, 30)]
    assert max(_vad_fp32(vad, f) for f in feeds) > 0.5
    assert max(_vad_truth(vad, f)[0] for f in feeds) < 0.01
    report = fp16lens.scan(vad, feeds, progress=False)
    fp16lens.patch(vad, report, out=tmp_path / "patched.onnx")
    art = fp16lens.export(str(tmp_path / "patched.onnx"), None, tmp_path / "fixed16.onnx")
    result = fp16lens.verify(vad, art.path, feeds)
    assert result and result.outputs["output"].max_abs < 0.01  # the speech probability


def test_silero_vad_onnx_with_context_gets_the_patch_that_reads_best_in_fp16(vad, tmp_path):
    """Raw int16 chunks with the 64 samples before each (as silero-vad's own wrapper feeds
    them): the rescaled graph misses min_cosine 0.999 on two chunks (the LSTM state
    saturates and flips), and keeping every span FP32 reads worse in real FP16 (three
    chunks, one of them read at about 1.0 by the rescaled graph). patch returns the
    rescaled graph and says what the wider one read; the exported FP16 file reads as the
    proof said on both chunks, and the tolerance patch names is then proven.
    Ground truth: rounding the inputs to FP16 alone flips the state in FP32."""
    import re
    import warnings

    import onnxruntime as ort

    from fp16lens.patch.onnx._patch import fp32_nodes

    cal = [zoo_real.vad_feed(raw=True, chunk=k) for k in range(1, 17)]
    report = fp16lens.scan(vad, cal, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16lens.patch(vad, report, batches=cal, out=tmp_path / "patched.onnx")
    said = " ".join(str(w.message) for w in caught if w.category is fp16lens.PatchWarning)
    encoder = [n.name for n in onnx.load(vad).graph.node if n.name.startswith("/model/encoder/")]
    assert encoder and not set(encoder) & set(fp32_nodes(onnx.load(tmp_path / "patched.onnx")))
    kept = re.search(
        r"on batch (\d+) \(cosine ([0-9.]+)\) with every span rescaled; keeping more of the "
        r"graph FP32 reads worse in FP16 \(cosine ([0-9.]+) on batch (\d+)\)",
        said,
    )
    assert kept and float(kept[3]) < float(kept[2]), said
    wider = float(kept[3]), int(kept[4])
    art = fp16lens.export(str(tmp_path / "patched.onnx"), None, tmp_path / "fixed16.onnx")
    for batch, want in ((int(kept[1]), float(kept[2])), (wider[1], None)):
        result = fp16lens.verify(vad, art.path, [cal[batch]])
        if want is not None:  # the proof's cosine, in the file the user takes home
            assert result.cosine == pytest.approx(want, abs=1e-4), result
        else:  # where keeping every span FP32 missed, the rescaled file holds
            assert result.cosine > wider[0] + 0.005, result
    ref = ort.InferenceSession(vad)
    batch = int(kept[1])
    rounded = {**cal[batch], "input": cal[batch]["input"].astype(np.float16).astype(np.float32)}
    state = ref.run(None, cal[batch])[1].ravel(), ref.run(None, rounded)[1].ravel()
    flip = float(state[0] @ state[1] / np.linalg.norm(state[0]) / np.linalg.norm(state[1]))
    assert flip < 0.999  # ground truth: the input's rounding alone flips the state in FP32
    tolerance = float(re.search(r"min_cosine=([0-9.]+)\) accepts", said)[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", fp16lens.PatchWarning)  # proven at that tolerance
        again = fp16lens.patch(vad, report, batches=cal, min_cosine=tolerance)
    assert fp32_nodes(again) == fp32_nodes(onnx.load(tmp_path / "patched.onnx"))


def test_silero_vad_onnx_span_into_its_decoder_if_is_rescaled_and_proven(vad, tmp_path):
    """Raw int16 samples of the whole sentence: the encoder's span runs on into the
    decoder's If (its LSTM reads the encoder's output from the outer scope). patch rescales
    the STFT and encoder by powers of two, keeps both Ifs FP32 and multiplies back the
    scaled tensor their branches read (the first If hands the second its output through a
    Mul of its own); exact in FP32, and proven in real FP16 on another speaker's chunks,
    where real FP16 storage of the original (no fp16lens) hears nothing."""
    cal = zoo_real.vad_chunks(zoo_real.SPEECH_WAV, 16)
    held = zoo_real.vad_chunks(zoo_real.SPEECH2_WAV, 8)
    report = fp16lens.scan(vad, cal, progress=False)
    assert any(s.end and "/model/decoder/If" in s.end for s in report.spans), report.spans
    fp16lens.patch(vad, report, batches=cal, out=tmp_path / "patched.onnx")
    import onnxruntime as ort

    from fp16lens.patch.onnx._patch import fp32_nodes

    want = [ort.InferenceSession(vad).run(None, f) for f in held]
    got = [ort.InferenceSession(str(tmp_path / "patched.onnx")).run(None, f) for f in held]
    for w, g in zip(want, got):  # exact: powers of two
        for a, b in zip(w, g):
            assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-30)
    islands = fp32_nodes(onnx.load(tmp_path / "patched.onnx"))
    assert {"/model/decoder/If", "/model/decoder/If_1"} <= set(islands)
    encoder = [n.name for n in onnx.load(vad).graph.node if n.name.startswith("/model/encoder/")]
    assert encoder and not set(encoder) & set(islands)  # rescaled, not kept FP32
    # ground truth: real FP16 storage of the original holds inf from its STFT on
    for f in held:
        assert _vad_truth(vad, f)[1].startswith("/model/stft/")
    art = fp16lens.export(str(tmp_path / "patched.onnx"), None, tmp_path / "fixed16.onnx")
    result = fp16lens.verify(vad, art.path, held)
    assert result and result.outputs["output"].max_abs < 0.01, result
