"""A forward that keeps state between calls (a streaming RNN's hidden state, as BeatNet's
beat tracker keeps ``self.hidden``): the verdict's check in real FP16 runs a copy of the
model, which starts from the state the watched calls left, so it must compare FP16 with
FP32 from that same state. Compared with the watched outputs instead, BeatNet's clean
network got "values FP16 flushes to 0: cosine 0.9488" (its FP32 second call against its
first: 0.9487), while FP16 from the same state gives 0.9999994."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fp16lens import watch


class StreamingLstm(nn.Module):
    """BeatNet's shape: a projection, an LSTM whose state the forward keeps, a head."""

    def __init__(self, tiny: float = 1.0):
        super().__init__()
        torch.manual_seed(3)
        self.proj = nn.Linear(16, 32)
        self.lstm = nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 3)
        self.hidden = torch.zeros(2, 1, 32)
        self.cell = torch.zeros(2, 1, 32)
        self.tiny = tiny

    def forward(self, x):
        y, (self.hidden, self.cell) = self.lstm(self.proj(x), (self.hidden, self.cell))
        out = self.head(y)
        return out * self.tiny * self.tiny / self.tiny / self.tiny if self.tiny != 1 else out


def _fp16_cosine_from(model: nn.Module, x: torch.Tensor) -> float:
    """Ground truth without fp16lens: FP16 and FP32 copies from the same state."""
    with torch.no_grad():
        want = copy.deepcopy(model)(x).flatten()
        half = copy.deepcopy(model).half()
        half.hidden, half.cell = half.hidden.half(), half.cell.half()
        got = half(x.half()).float().flatten()
    return float(F.cosine_similarity(want, got, dim=0))


def test_a_clean_streaming_model_gets_a_clean_verdict():
    model = StreamingLstm().eval()
    x = torch.rand(1, 40, 16) * 3
    assert _fp16_cosine_from(model, x) > 0.9999  # clean in real FP16
    before = copy.deepcopy(model)
    with torch.no_grad():
        first = before(x)
        assert F.cosine_similarity(first.flatten(), before(x).flatten(), dim=0) < 0.999  # state
        with watch(model) as lens:
            out = model(x)
    assert torch.equal(out, first)
    assert lens.report.clean, [f.detail for f in lens.report.findings]
    assert torch.equal(model.hidden, copy.deepcopy(model).hidden)  # one call's state, kept
    with torch.no_grad():
        again = copy.deepcopy(StreamingLstm().eval())
        again(x)
    assert torch.equal(model.hidden, again.hidden) and torch.equal(model.cell, again.cell)


def test_a_streaming_model_that_fp16_breaks_is_still_found():
    """The same model whose output passes through values FP16 flushes (x 1e-8, then back):
    real FP16 from the same state loses them, and the verdict says so."""
    model = StreamingLstm(tiny=1e-4).eval()
    x = torch.rand(1, 40, 16) * 3
    assert _fp16_cosine_from(model, x) < 0.9  # broken in real FP16
    with torch.no_grad(), watch(model) as lens:
        model(x)
    assert not lens.report.clean


def test_beatnets_network_with_its_weights_gets_a_clean_verdict_on_two_speakers():
    """The real model: BeatNet's shipped weights, on beat features of two speakers. Real FP16
    from the same state is clean; the verdict was "values FP16 flushes to 0" before."""
    import zoo_real

    model = zoo_real.or_skip(zoo_real.beatnet_bda)
    for wav in (zoo_real.SPEECH_WAV, zoo_real.SPEECH2_WAV):
        x = zoo_real.beat_features(wav)
        assert _fp16_cosine_from(model, x) > 0.9999
        with torch.no_grad(), watch(model) as lens:
            model(x)
        assert lens.report.clean, [f.detail for f in lens.report.findings]
