"""patch() on the families it used to give up on, judged by real FP16 on CPU
(``copy.deepcopy(m).half()``): a planted overflow is inf/NaN in FP16 before the patch,
finite and close to FP32 after it, the FP32 outputs unchanged, and no FP32 island where
rescaling applies. Part 1: norm modules recognized by what they compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16lens._core.algebra import Kind, fused_kind, module_kind
from fp16lens.patch import patch

from models import fused_norms, rms_norm_head
from plant import assert_fixed
from plant import watch_report as _report


def _fixed(model, inputs):
    """The planted overflow is fixed (``plant.assert_fixed``)."""
    return assert_fixed(model, inputs)[0]


@pytest.mark.parametrize("plant", ["frozen", "stats"])
def test_fused_batch_norms_are_rescaled_without_islands(plant):
    model, inputs = fused_norms(plant)
    the_plan = _fixed(model, inputs)
    assert not the_plan.islands and not the_plan.unresolved and not the_plan.multiplies
    rewritten = {r.module: r.rule for r in the_plan.reparametrized}
    if plant == "frozen":  # FrozenBatchNorm2d's affine part takes 1/p, c3 takes p
        assert rewritten["fb"].startswith("bn") and rewritten["c3"] == "linear"
    else:  # bn3's statistics are beyond FP16: its exact affine form
        assert rewritten["bn3"] == "bn-affine" and rewritten["c3"] == "linear"


@pytest.mark.parametrize("kind", ["t5", "llama"])
def test_hf_rms_norms_are_invariant_exits(kind):
    model, inputs = rms_norm_head(kind)
    the_plan = _fixed(model, inputs)
    assert not the_plan.islands and not the_plan.unresolved
    rewritten = {r.module: r for r in the_plan.reparametrized}
    assert rewritten["norm"].rule == "norm" and rewritten["norm"].s_out == 1
    p = rewritten["norm"].s_in
    assert (
        model.norm.variance_epsilon / (p * p)
        == patch(model, _report(model, inputs)).norm.variance_epsilon
    )


def test_recognized_by_what_they_compute_not_by_name():
    from torchvision_compat import need_torchvision

    need_torchvision()
    layers = pytest.importorskip("timm.layers")
    BatchNormAct2d, LayerNorm2d = layers.BatchNormAct2d, layers.LayerNorm2d
    from torchvision.ops.misc import FrozenBatchNorm2d
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    assert module_kind(BatchNormAct2d(4)) == Kind.BN and fused_kind(FrozenBatchNorm2d(4)) == Kind.BN
    assert fused_kind(T5LayerNorm(4)) == Kind.NORM and fused_kind(LayerNorm2d(4)) == Kind.NORM

    class Cached(FrozenBatchNorm2d):  # a scale computed once: rewriting buffers changes nothing
        def __init__(self, n):
            super().__init__(n)
            self.register_buffer("scale", self.weight * (self.running_var + self.eps).rsqrt())

        def forward(self, x):
            return x * self.scale.view(1, -1, 1, 1) + (
                self.bias - self.running_mean * self.scale
            ).view(1, -1, 1, 1)

    class NotInvariant(T5LayerNorm):  # adds a constant after the norm: no eps makes it invariant
        def forward(self, x):
            return super().forward(x) + 1.0

    class OnePlus(nn.Module):  # Gemma-style (1 + weight): invariant, but not a weight that absorbs
        def __init__(self, n):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.rand(n)), 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    assert fused_kind(Cached(4)) is None and fused_kind(NotInvariant(4)) is None
    assert fused_kind(OnePlus(4)) is None and module_kind(Cached(4)) == Kind.BLOCK
