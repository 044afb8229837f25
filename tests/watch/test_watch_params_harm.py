"""A parameter FP16 flushes or rounds is a problem only where the loss shows in FP16.

Ground truth is real FP16 (``copy.deepcopy(model).half()``): where the report calls a loss
harmless, real FP16 keeps the output; where it calls it a problem, real FP16 loses it.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from fp16lens import watch
from fp16lens._core import half_step
from fp16lens._core.flush import REL_STEP, flush_loss

import models


def _watch(model, inputs):
    with torch.no_grad(), watch(model) as lens:
        out = model(*inputs)
    return lens.report, out


def _fp16(model, inputs):
    with torch.no_grad():
        return copy.deepcopy(model).half()(*[t.half() for t in inputs]).float()


def _verdict_line(report) -> str:
    console = Console(width=200, color_system=None, record=True, file=io.StringIO())
    report.print(console=console)
    return console.export_text().splitlines()[0]


def test_half_step_is_half_the_fp16_spacing():
    for m in (1.0, 0.3, 1000.0, 2.0**-14):
        x = torch.tensor(m, dtype=torch.float16).float()
        up = torch.nextafter(
            torch.tensor(m, dtype=torch.float16), torch.tensor(1e9, dtype=torch.float16)
        )
        assert half_step(float(x)) == (float(up) - float(x)) / 2
    assert half_step(1e-6) == half_step(0.0) == 2.0**-25  # the subnormal step


def test_flush_loss_per_value_and_per_output_channel():
    w = torch.tensor([[0.5, 1e-8, 1e-8], [0.25, 0.25, 0.5]])
    loss = flush_loss(w)
    assert loss.value == pytest.approx(1e-8)  # flushed to 0: all of it is lost
    assert loss.slice == pytest.approx(2e-8)  # the first output channel loses two of them
    assert loss.rel == pytest.approx(2e-8 / (0.5 + 2e-8))
    sub = flush_loss(torch.tensor([1e-6]))  # subnormal: only the rounding is lost
    assert sub.value == pytest.approx(abs(1e-6 - float(torch.tensor(1e-6).half())))
    assert flush_loss(torch.tensor([0.1, 3.0])).value == 0.0  # normal values: nothing below 2^-14


@pytest.mark.slow
def test_mobilenet_v2_with_tiny_bn_biases_is_fp16_safe():
    model, inputs, tiny = models.mobilenet_v2_tiny_params()
    report, ref = _watch(model, inputs)
    notes = {
        f"{f.site}.{f.tensor}": f for f in report.findings_by("note") if f.kind.startswith("param-")
    }
    assert report.findings_by("parameter") == []
    assert report.clean and _verdict_line(report).startswith("✓ MobileNetV2 is FP16-safe")
    assert set(tiny) <= set(notes)  # each tiny bias is a note that says why it is harmless
    assert all("harmless" in notes[n].detail and notes[n].kind == "param-underflow" for n in tiny)
    assert any(f.kind == "param-subnormal" for f in notes.values())  # the small pointwise weights
    half = copy.deepcopy(model).half()
    params = dict(half.named_parameters())
    assert all(torch.count_nonzero(params[n]) == 0 for n in tiny)  # FP16 really flushes them
    # ground truth: real FP16 keeps the output; the flush itself moves the FP32 output by
    # less than FP16's own rounding
    out16 = _fp16(model, inputs)
    assert F.cosine_similarity(out16.flatten(), ref.flatten(), 0) >= 0.999
    flushed = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in flushed.named_parameters():
            if name in notes:
                p.copy_(p.half().float())
        moved = (flushed(*inputs) - ref).abs().max()
    assert moved <= REL_STEP * ref.abs().max()


def test_layer_scale_that_fp16_flushes_stays_a_problem():
    model, inputs = models.layer_scale_readout(gamma=1e-8)
    report, ref = _watch(model, inputs)
    (f,) = report.findings_by("parameter")
    assert (f.site, f.tensor, f.kind, f.count) == ("", "gamma", "param-underflow", 16)
    assert "visible" in f.detail and not report.clean
    assert _verdict_line(report).startswith("✗ LayerScaleReadout")
    # ground truth: real FP16 drops the branch γ·proj (γ becomes 0), which is as large as
    # the residual x it is added to
    branch = ref - inputs[0]
    out16 = _fp16(model, inputs)
    assert float(branch.abs().max()) > 1e-5
    assert (out16 - ref).abs().max() > 0.5 * branch.abs().max()
    assert F.cosine_similarity((out16 - inputs[0]).flatten(), branch.flatten(), 0) < 0.5


def test_same_block_with_a_representable_layer_scale_is_clean():
    model, inputs = models.layer_scale_readout(gamma=1e-3)
    report, ref = _watch(model, inputs)
    assert report.clean and not [f for f in report.findings if f.kind.startswith("param-")]
    assert F.cosine_similarity(_fp16(model, inputs).flatten(), ref.flatten(), 0) > 0.9999


def test_parameter_overflow_stays_a_problem():
    model, inputs = models.bn_huge_var()
    report, _ = _watch(model, inputs)
    (f,) = report.findings_by("parameter")
    assert (f.site, f.tensor, f.kind) == ("bn", "running_var", "param-overflow")
    with torch.no_grad():
        assert torch.isinf(copy.deepcopy(model).half().bn.running_var).all()


class _CausalMask(torch.nn.Module):
    """Attention scores masked by a buffer of -inf above the diagonal (a causal mask as
    many decoders register it): FP16 holds -inf as it is."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("mask", torch.full((6, 6), -torch.inf).triu(1))

    def forward(self, x):
        q = self.proj(x)
        return torch.softmax(q @ q.transpose(-1, -2) / 8**0.5 + self.mask, -1) @ x


def test_an_inf_buffer_is_no_parameter_problem():
    model, inputs = _CausalMask().eval(), (torch.randn(2, 6, 8),)
    report, out = _watch(model, inputs)
    half = _fp16(model, inputs)
    assert torch.isfinite(half).all() and torch.allclose(half, out, atol=5e-3)  # ground truth
    assert not [f for f in report.findings if f.mechanism == "parameter"]
    assert report.clean, [f.detail for f in report.findings]
    from fp16lens.export._ranges import range_issues

    assert range_issues(model.mask.numpy()).overflow == 0  # export keeps it too
