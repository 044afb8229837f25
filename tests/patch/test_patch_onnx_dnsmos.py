"""DNSMOS P.835 (Microsoft's speech-quality scorer, ``sig_bak_ovr.onnx`` as the speechmos
0.0.1.1 wheel ships it: an STFT by two convs, ``max(1e-12, sqrt(re² + im²)^p)``, a log, a
CNN; SIG, BAK and OVRL out), fed 9.01 s of audio in [-1, 1] as speechmos feeds it.

Ground truth without fp16lens: the FP32 graph with real FP16 storage
(``zoo_real.onnx_real_fp16``) scores NaN on most speech (both squares of quiet STFT bins
flush to 0, and so does the 1e-12 guard: log(0)), and off by up to a whole MOS point where
it stays finite. For the fix, the FP16 file fp16lens exports, its FP16 storage made real
(``zoo_real.onnx_fp16_file_real``), on audio the patch never saw."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402

import fp16lens  # noqa: E402

SAMPLES = 144160  # speechmos: INPUT_LENGTH 9.01 s at 16 kHz


def _audio() -> dict[str, dict]:
    """The first speaker looped to 9.01 s (the calibration), the second, the second 40 dB
    quieter, silence then the first speaker, and hiss: [-1, 1] floats."""
    one = np.resize(zoo_real.speech().numpy()[0], SAMPLES) / 32768
    two = np.resize(zoo_real.speech(path=zoo_real.SPEECH2_WAV).numpy()[0], SAMPLES) / 32768
    half = SAMPLES // 2
    sounds = {
        "speech": one,
        "speaker 2": two,
        "quiet": two / 100,
        "silence, then speech": np.concatenate([np.zeros(half), one[: SAMPLES - half]]),
        "hiss": np.random.default_rng(0).normal(0, 0.01, SAMPLES),
    }
    return {k: {"input_1": v[None].astype(np.float32)} for k, v in sounds.items()}


def test_dnsmos_that_real_fp16_breaks_by_underflow_is_fixed_from_the_squares_on(tmp_path):
    """The scan finds the flushes before the log; patch keeps FP32 from the STFT's two
    squares on (where the flushes start, joined by an Add), not from the power after the
    magnitude, which leaves real FP16 at cosine 0.963; the proof passes on one batch, and
    the FP16 export scores four clips it never saw within 0.01 of FP32."""
    path = zoo_real.or_skip(zoo_real.dnsmos_model)
    feeds = _audio()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    refs = {k: sess.run(None, f)[0] for k, f in feeds.items()}
    for kind in ("speech", "quiet", "silence, then speech"):  # ground truth: NaN
        (half,) = zoo_real.onnx_real_fp16(path, feeds[kind]).values()
        assert np.isnan(half).all(), kind
    (half,) = zoo_real.onnx_real_fp16(path, feeds["speaker 2"]).values()
    assert np.abs(half - refs["speaker 2"]).max() > 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = fp16lens.scan(path, [feeds["speech"]], progress=False)
    (f,) = report.findings_by("underflow")
    assert f.site == "mos_estimator_logpow/Log"
    assert "FP32 islands (7, in order): mos_estimator_logpow/time2freq/Square," in f.fix
    fixed = zoo_real.patched_fp16_file(path, report, [feeds["speech"]], tmp_path)
    for kind, feed in feeds.items():
        (got,) = zoo_real.onnx_fp16_file_real(str(fixed.path), feed).values()
        assert np.abs(got - refs[kind]).max() < 0.01, kind
