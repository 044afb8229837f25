"""The FP16 meta trace (which ops a .half() model computes in FP32) runs only where a
value passes the threshold: never for a clean model, once otherwise, and then with the
report it gave when it ran before the first forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp16lens import watch
from fp16lens._trace import _half as _halfdtypes

import models


@pytest.fixture
def meta_runs(monkeypatch):
    calls = []
    real = _halfdtypes.run_half_on_meta

    def counted(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(_halfdtypes, "run_half_on_meta", counted)
    return calls


def test_clean_model_never_runs_the_meta_trace(meta_runs):
    model, inputs = models.seed_case()
    model = model.eval()
    x = inputs[0] * 1e-3  # well inside FP16 range
    with torch.no_grad():
        truth = copy.deepcopy(model).half()(x.half())
        cosine = float(
            torch.nn.functional.cosine_similarity(
                truth.double().flatten(), model(x).double().flatten(), dim=0
            )
        )
    assert torch.isfinite(truth).all()  # ground truth: every value in range in real FP16
    with torch.no_grad(), watch(model, params=False) as lens:  # (its BN stats are a note)
        for _ in range(3):
            out = model(x)
    assert meta_runs == []  # the forwards never ran it
    assert lens.report.spans == []
    # reading the verdict checks it in real FP16: finite, but its BN statistics cost
    # precision at this input scale (cosine 0.963), named as precision, not range
    (f,) = lens.report.findings
    assert (f.kind, f.tensor) == ("fp16-run", "precision")
    assert f.peak == pytest.approx(cosine, abs=1e-3)
    with torch.no_grad():
        assert torch.equal(out, model(x))


class CachesInForward(nn.Module):
    """Caches an FP32 table in forward (as rotary embeddings do): FP32 under .half()."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x, scale=1.0):
        key = x.shape[-1]
        if key not in self.cache:
            self.cache[key] = torch.arange(key, dtype=torch.float32)
        return x + self.cache[key] * scale


def test_trace_runs_once_at_the_first_forward_out_of_range(meta_runs):
    model = CachesInForward()
    x = torch.rand(2, 8)
    with torch.no_grad():
        truth = copy.deepcopy(model).half()(x.half(), 1e5)
    assert torch.isfinite(truth).all() and truth.abs().max() > 65504  # FP32 under .half()
    with torch.no_grad(), watch(model) as lens:
        model(x)
        assert meta_runs == []  # clean so far
        cached = model.cache[8]
        model(x, 1e5)  # out of range: traced now, from the first call's inputs
        assert len(meta_runs) == 1
        model(x, 1e5)
    assert len(meta_runs) == 1
    assert model.cache[8] is cached and cached.device.type == "cpu" and list(model.cache) == [8]
    report = lens.report
    assert report.spans == []
    notes = [f for f in report.findings if f.kind == "fp32-upcast"]
    assert [n.site for n in notes] == [":mul"] and notes[0].count == 2 and notes[0].batch == 1


class Counts(CachesInForward):
    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, x, scale=1.0):
        self.n += 1
        return super().forward(x, scale)


def test_deferred_trace_leaves_the_modules_state_as_the_real_calls_made_it(meta_runs):
    model = Counts()
    with torch.no_grad(), watch(model) as lens:
        model(torch.rand(2, 8), 1e5)
        model(torch.rand(2, 8), 1e5)
    assert len(meta_runs) == 1 and lens._recorder.half_fp32
    assert model.n == 2 and model.training and model.cache[8].device.type == "cpu"


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(cfg)


def _t5():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(
        d_model=64, num_layers=2, num_heads=4, d_ff=128, d_kv=16, vocab_size=100
    )
    return transformers.T5EncoderModel(cfg)


@pytest.mark.parametrize(("build", "scale"), [(_llama, 2e4), (_t5, 2e3)], ids=["llama", "t5"])
def test_upcasts_found_by_the_deferred_trace(build, scale, meta_runs):
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad(), watch(model) as clean:
        model(ids)
    # (T5's log(0) = -inf in its position buckets is a masking value, not out of range)
    assert meta_runs == [] and clean.report.spans == []
    meta_runs.clear()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)  # x^2 in the upcast norms > 65504
    with torch.no_grad(), watch(model) as lens:
        model(ids)
        model(ids)
    assert len(meta_runs) == 1
    report = lens.report
    assert report.spans == []  # the x^2 past 65504 is FP32 in a .half() model
    notes = [f for f in report.findings if f.kind == "fp32-upcast"]
    assert notes and notes[0].site.endswith(":pow") and notes[0].batch == 0
    with torch.no_grad(), watch(model, half_dtypes=False) as naive:
        model(ids)
    assert naive.report.spans  # counted as FP16, the upcast x^2 would be overflow
