"""scan(compile=True) against the eager scan, site by site.

The eager path is the reference: the compiled report must have the same sites (module
sites and ``module:op#n`` sites), the same absmax per site (1e-6 relative), the same
edges, spans and findings. Batches grow from one to the next, so the largest values come
from the last batch, which runs through the compiled graph (asserted with
``absmax_batch``). Inductor compiles three tiny models (marked slow: tens of seconds each
on two cores); the rest run the captured graph as it is (``backend="fx"``), which tests
the capture (sites, dataflow, statistics as graph outputs) without the compiler.
The seed case's span is checked against real FP16 (models.first_inf_site_fp16).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import fp16lens
from fp16lens._core import WatchError
from fp16lens._core.sites import FindingKind, Mechanism, site_module
from fp16lens.report._advice import suggest_fix
from fp16lens.watch._compiled_scan import FALLBACK, scan_compiled

import models


def _batches(inputs: tuple, n: int) -> list[tuple]:
    """``n`` batches, each float input scaled up a little more than the one before."""
    return [
        tree_map(lambda t, g=1 + 0.25 * i: t * g if t.is_floating_point() else t, inputs)
        for i in range(n)
    ]


def _notes(report) -> list[str]:
    found = [f for f in report.findings if f.detail.startswith(FALLBACK)]
    assert all(
        f.kind == FindingKind.COMPILE_FALLBACK and f.mechanism == Mechanism.NOTE for f in found
    )
    assert all("watched eagerly" in suggest_fix(report, f) for f in found)
    return [f.detail for f in found]


def _compare(model: nn.Module, inputs: tuple, backend: str, n: int = 4):
    batches = _batches(inputs, n)
    eager = fp16lens.scan(model, batches, progress=False)
    with torch.no_grad():
        before = ({k: v.clone() for k, v in model.state_dict().items()}, model(*inputs))
    compiled, timings = scan_compiled(model, batches, progress=False, backend=backend)
    with torch.no_grad():  # Inductor froze the weights into its graph: the model keeps them
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in before[0].items())
        assert torch.equal(torch.as_tensor(model(*inputs)[0]), torch.as_tensor(before[1][0]))
    assert timings.fallbacks == [] and not _notes(compiled)
    assert timings.compiled_batches == n - 2  # eager first, captured second, compiled after
    assert list(compiled.sites) == list(eager.sites)
    for name, want in eager.sites.items():
        got = compiled.sites[name]
        assert math.isclose(got.absmax, want.absmax, rel_tol=1e-6), (name, got.absmax, want.absmax)
        assert (got.calls, got.shape) == (want.calls, want.shape)  # (a scale-invariant site
        # peaks in every batch alike: which batch holds the max is a matter of rounding)
    assert compiled.edges == eager.edges
    assert [(s.start, s.end, s.sites, s.ends, s.batches) for s in compiled.spans] == [
        (s.start, s.end, s.sites, s.ends, s.batches) for s in eager.spans
    ]
    assert [(f.site, f.mechanism, f.kind) for f in compiled.findings] == [
        (f.site, f.mechanism, f.kind) for f in eager.findings
    ]
    # the largest values come from the last batch, a compiled one
    assert max(s.absmax_batch for s in compiled.sites.values()) == n - 1
    return eager, compiled


# ---- the captured graph as it is (no compiler): fast --------------------------------
def test_seed_case_span_from_the_graph_matches_eager_and_real_fp16():
    model, inputs = models.seed_case()
    eager, compiled = _compare(model, inputs, "fx", n=3)
    truth = models.first_inf_site_fp16(model, inputs)
    assert truth is not None and compiled.spans and compiled.spans[0].start == truth[0]
    assert [s.peak for s in compiled.spans] == pytest.approx(
        [s.peak for s in eager.spans], rel=1e-6
    )


@pytest.mark.parametrize(
    "builder",
    [models.mha_fastpath, models.attention_span, models.layernorm_variance, models.sdpa_attention],
)
def test_fused_attention_and_internal_checks_match_eager(builder):
    model, inputs = builder()
    eager, compiled = _compare(model, inputs, "fx")
    assert [f.peak for f in compiled.findings] == pytest.approx(
        [f.peak for f in eager.findings], rel=1e-6
    )


def test_each_input_shape_gets_its_own_graph():
    model, (x,) = models.clean()
    batches = [(x,), (x * 2,), (torch.rand(2, 3, 8, 8),), (torch.rand(2, 3, 8, 8) * 3,), (x * 4,)]
    eager = fp16lens.scan(model, batches, progress=False)
    compiled, timings = scan_compiled(model, batches, progress=False, backend="fx")
    assert (timings.eager_batches, timings.traced_batches, timings.compiled_batches) == (1, 2, 2)
    assert compiled.meta.input_shapes == eager.meta.input_shapes
    for name, want in eager.sites.items():
        assert compiled.sites[name].absmax == pytest.approx(want.absmax, rel=1e-6)


class ValueBranch(nn.Module):
    """Python control flow on a tensor's value: no graph stands for every batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) * 3 if h.sum() > 0 else self.b(-h)


class MaskedRows(nn.Module):
    """A boolean-mask selection: the output's shape depends on the values."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h[h > 0].sum() * 1e5


@pytest.mark.parametrize(
    ("cls", "why"),
    [
        (ValueBranch, "_local_scalar_dense in the model's own forward"),
        (MaskedRows, "output shape comes from the values"),
    ],
)
def test_data_dependent_model_falls_back_to_the_eager_report_with_a_note(cls, why):
    torch.manual_seed(0)
    model = cls().eval()
    batches = [(torch.randn(4, 8) * s,) for s in (1.0, -1.0, 2.0, -3.0)]
    eager = fp16lens.scan(model, batches, progress=False)
    compiled = fp16lens.scan(model, batches, progress=False, compile=True)
    notes = _notes(compiled)
    assert len(notes) == 1 and why in notes[0] and "depends on tensor values" in notes[0]
    compiled.findings = [f for f in compiled.findings if f.detail not in notes]
    assert compiled == eager
    assert compiled.spans == eager.spans  # MaskedRows: its sum overflows in every batch


def test_compile_failure_falls_back_to_the_eager_report_with_a_note():
    model, inputs = models.gelu_span()
    batches = _batches(inputs, 4)
    eager = fp16lens.scan(model, batches, progress=False)
    compiled, timings = scan_compiled(model, batches, progress=False, backend="no-such-backend")
    notes = _notes(compiled)
    assert len(notes) == 1 and "torch.compile could not compile the captured graph" in notes[0]
    assert (timings.eager_batches, timings.traced_batches, timings.compiled_batches) == (3, 1, 0)
    compiled.findings = [f for f in compiled.findings if f.detail not in notes]
    assert compiled.spans == eager.spans and list(compiled.sites) == list(eager.sites)
    for name, want in eager.sites.items():
        assert compiled.sites[name].absmax == pytest.approx(want.absmax, rel=1e-6)


def test_compile_refuses_an_onnx_model():
    with pytest.raises(WatchError, match="compile=True applies to torch modules"):
        fp16lens.scan("model.onnx", [{"x": torch.ones(1)}], compile=True)


# ---- Inductor (slow: tens of seconds of compile each on 2 CPU cores) -------------------
@pytest.mark.slow
def test_inductor_conv_bn_net_matches_eager():
    model, inputs = models.clean()
    assert models.first_inf_site_fp16(model, inputs) is None  # real FP16 stays finite
    eager, compiled = _compare(model, inputs, "inductor")
    assert eager.clean and compiled.clean  # a clean model gets a clean verdict


@pytest.mark.slow
def test_inductor_functional_add_cat_interpolate_matches_eager():
    neck = models.FPNNeck(channels=(4, 8, 8, 8), width=4).eval()
    feats = tuple(torch.rand(1, c, s, s) for c, s in zip((4, 8, 8, 8), (16, 8, 4, 2)))
    _, compiled = _compare(neck, (feats,), "inductor")
    ops = {s.op for s in compiled.sites.values() if s.kind == "op"}
    assert {"add", "cat", "upsample_nearest2d", "upsample_bilinear2d"} <= ops


@pytest.mark.slow
def test_inductor_transformer_encoder_layer_span_matches_eager_and_real_fp16():
    model, inputs = models.encoder_fastpath()
    eager, compiled = _compare(model, inputs, "inductor")
    assert [s.peak for s in compiled.spans] == pytest.approx(
        [s.peak for s in eager.spans], rel=1e-6
    )
    truth = models.first_inf_site_fp16(model, inputs)  # real FP16 overflows where the span starts
    assert truth is not None and compiled.spans
    start = site_module(compiled.spans[0].start)
    # torch < 2.5 runs the whole layer as one fused op even under hooks: inf shows at 'layer'
    assert start == truth[0] or start.startswith(truth[0] + "."), (start, truth)
