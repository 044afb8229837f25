"""openWakeWord (the openwakeword 0.5.1 wheel's ONNX models: a melspectrogram front end fed
int16 samples as float, Google's speech embedding, and small wake-word heads with two
decomposed LayerNorms each), on the shipped speech of two speakers, digital silence and
noise, as openwakeword feeds them.

Ground truth without fp16lens: the FP32 graphs with real FP16 storage
(``zoo_real.onnx_real_fp16``). The melspectrogram's STFT power of int16 samples passes
65504 and gives inf/NaN; "hey mycroft" stores (x-mean)^2 up to 1.5e6 in its first
LayerNorm and, in real FP16, wakes (score 1.0) on every window, speech, noise or silence.
The other heads are clean in real FP16 and must get a clean verdict. For the fixes, the
FP16 file fp16lens exports, its FP16 storage made real (``zoo_real.onnx_fp16_file_real``),
on inputs the patch never saw."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens.cli import main  # noqa: E402


def _model(name: str) -> str:
    return zoo_real.or_skip(zoo_real.openwakeword_model, name)


def _samples() -> dict[str, np.ndarray]:
    """One second each, int16: the first speaker's start (the calibration), its end, the
    second speaker, digital silence, and quiet noise."""
    one = zoo_real.speech().numpy()[0].astype(np.int16)
    two = zoo_real.speech(path=zoo_real.SPEECH2_WAV).numpy()[0].astype(np.int16)
    hiss = np.random.default_rng(0).normal(0, 30, 16000).astype(np.int16)
    return {
        "speech": one[:16000],
        "speech end": one[-16000:],
        "speaker 2": two[20000:36000],
        "silence": np.zeros(16000, np.int16),
        "hiss": hiss,
    }


def _run(path: str, feed: dict) -> np.ndarray:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_melspectrogram_broken_by_int16_samples_is_fixed_for_audio_it_never_saw(tmp_path):
    """Real FP16 of the front end is non-finite on speech; the scan finds the span from
    the STFT convs to the Log; the patch, proven on one second of speech, is exported as
    FP16, and that file in real FP16 storage matches FP32 on speech of another speaker,
    on silence and on noise, within what rounding the int16 samples to FP16 costs alone,
    and its islands are worded in the order the graph runs them."""
    mel = _model("melspectrogram")
    feeds = {k: {"input": v[None].astype(np.float32)} for k, v in _samples().items()}
    for kind in ("speech", "speech end", "speaker 2"):  # ground truth: real FP16 breaks
        (half,) = zoo_real.onnx_real_fp16(mel, feeds[kind]).values()
        assert not np.isfinite(half).all(), kind
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = fp16lens.scan(mel, [feeds["speech"]], progress=False)
    (span,) = report.spans
    assert (span.start, span.ends) == ("Conv_2", ["Log_17"])
    islands = re.search(r"FP32 islands \(\d+, in order\): ([^;]*)", span.fix)
    assert islands, span.fix
    order = [n.name for n in onnx.load(mel).graph.node]
    named = [w.split(" (")[0] for w in islands.group(1).split(", ")]
    assert named == sorted(named, key=order.index)  # graph order, not alphabetical
    fixed = zoo_real.patched_fp16_file(mel, report, [feeds["speech"]], tmp_path)
    for kind, feed in feeds.items():
        rounded = _run(mel, {"input": feed["input"].astype(np.float16).astype(np.float32)})
        (got,) = zoo_real.onnx_fp16_file_real(str(fixed.path), feed).values()
        assert np.isfinite(got).all(), kind
        assert np.abs(got - rounded).max() <= 0.5, kind  # dB; the output spans 20-100 dB


@pytest.fixture(scope="module")
def audio() -> dict[str, np.ndarray]:
    """3.75 s each, int16: the first speaker twice over, the second, silence, noise."""
    _model("embedding_model")
    one = zoo_real.speech().numpy()[0].astype(np.int16)
    two = zoo_real.speech(path=zoo_real.SPEECH2_WAV).numpy()[0].astype(np.int16)
    noise = np.random.default_rng(1).normal(0, 300, 60000).astype(np.int16)
    return {
        "speech": np.concatenate([one, one])[:60000],
        "speaker 2": two[:60000],
        "silence": np.zeros(60000, np.int16),
        "noise": noise,
    }


def _feeds(path: str, audio: dict[str, np.ndarray]) -> dict[str, list[dict]]:
    """Per sound, every third input of the wake-word model at ``path``, computed in FP32
    as openwakeword does (``zoo_real.wakeword_windows``)."""
    (x,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).get_inputs()
    return {
        k: [{x.name: w[None]} for w in zoo_real.wakeword_windows(v, x.shape[1])[::3]]
        for k, v in audio.items()
    }


def _logits(path: str) -> str:
    """The tensor the wake-word head's Sigmoid reads."""
    (node,) = [n for n in onnx.load(path).graph.node if n.op_type == "Sigmoid"]
    return node.input[0]


def test_hey_mycroft_that_wakes_on_everything_in_real_fp16_is_fixed_exactly(
    audio, tmp_path, capsys
):
    """Real FP16 scores 1.0 where FP32 scores 0 (speech, silence, noise). The scan names
    the LayerNorm's (x-mean)^2 and its sum before the mean; both fixes are the rescaling
    patch applies (advice = plan) and the headline keeps its parenthesis whole. The FP16
    export, in real FP16 storage, gives FP32's logits on windows the patch never saw."""
    path = _model("hey_mycroft_v0.1")
    feeds = _feeds(path, audio)
    for kind, batch in feeds.items():  # ground truth: a wake on every window
        for feed in batch:
            assert _run(path, feed).max() < 0.01, kind
            (half,) = zoo_real.onnx_real_fp16(path, feed).values()
            assert half.max() > 0.99, kind
    calibration = feeds["speech"][:1]
    report = fp16lens.scan(path, calibration, progress=False)
    (span,) = report.spans
    (internal,) = report.findings_by("internal")
    assert internal.site == "ReduceMean_2" and "Gemm_1 absorb 2^-6" in internal.fix
    assert "Gemm_1 absorb 2^-6" in span.fix
    assert "plans nothing" not in internal.fix
    np.savez(tmp_path / "w.npz", **calibration[0])
    argv = ["scan", path, "--input", str(tmp_path / "w.npz"), "--fail-on", "overflow"]
    assert main(argv) == 1
    out = " ".join(capsys.readouterr().out.split())
    nxt = out[out.index("Next:") :].split(" — ")[0]
    assert nxt.count("(") == nxt.count(")"), nxt
    art = zoo_real.patched_fp16_file(path, report, calibration, tmp_path)
    assert "may change the output" not in " ".join(art.warnings)  # the eps are added: harmless
    logits = _logits(path)
    for kind, batch in feeds.items():
        for feed in batch:
            got = zoo_real.onnx_fp16_file_real(str(art.path), feed, (logits,))
            assert got[next(iter(got))].max() < 0.01, kind  # no wake
            assert _cosine(_fp32_tensor(path, feed, logits), got[logits]) > 0.9999, kind


def _fp32_tensor(path: str, feed: dict, tensor: str) -> np.ndarray:
    m = onnx.load(path)
    m.graph.output.extend([onnx.helper.make_tensor_value_info(tensor, 1, None)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([tensor], feed)[0]


@pytest.mark.parametrize("head", ["alexa_v0.1", "timer_v0.1", "weather_v0.1"])
def test_wake_word_heads_clean_in_real_fp16_get_a_clean_verdict(audio, head):
    """These heads store nothing beyond FP16 on speech, silence or noise: real FP16
    scores as FP32 does (timer fires on the second speaker in both), and the scan says
    FP16-safe."""
    path = _model(head)
    batches = [feed for feeds in _feeds(path, audio).values() for feed in feeds]
    for feed in batches:
        (half,) = zoo_real.onnx_real_fp16(path, feed).values()
        assert np.abs(half - _run(path, feed)).max() < 0.01
    report = fp16lens.scan(path, batches, progress=False)
    assert report.clean, [(f.mechanism, f.site) for f in report.findings]
