"""patch() where a span meets an activation no scale passes (SiLU, GELU, hardswish,
sigmoid, tanh), judged by real FP16 on CPU (``copy.deepcopy(m).half()``): the FP32
island is the activation alone, fed and read in FP16 through its scales, and the
exits around it keep every stored parameter inside FP16."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp16lens.patch import get_plan, patch, relative_error

from models import huge_weight_head
from plant import cosine, plant_overflow, run_half, watch_report

_ACTS = (nn.SiLU, nn.GELU, nn.Hardswish, nn.Sigmoid, nn.Tanh, nn.ReLU, nn.ReLU6)


def _island_types(model: nn.Module, the_plan) -> set[type]:
    return {type(model.get_submodule(i.module)) for i in the_plan.islands}


def _stored_beyond_fp16(model: nn.Module) -> list[str]:
    """Parameters and buffers of ``model.half()`` that FP16 cannot hold (inf/NaN)."""
    half = copy.deepcopy(model).half()
    tensors = [*half.named_parameters(), *half.named_buffers()]
    return [n for n, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]


@pytest.mark.slow
@torch.no_grad()
def test_efficientnet_exit_batch_norm_keeps_its_weight_inside_fp16():
    """torchvision efficientnet_b0 (random weights) with a planted overflow: the region's
    factor is 2^40 (the planted batch norm's affine scale is 7e15), its exit conv in the
    next block cannot take it alone, so its output carries 2^26 and the exit batch norm
    after it would store gamma/sigma x 2^26 (6.7e7, inf in FP16). The batch norm's output
    class now takes a factor too, absorbed by the SiLU after it (a scaled FP32 island)."""
    from torchvision_compat import need_torchvision

    tv = need_torchvision()
    torch.manual_seed(0)
    model = tv.models.efficientnet_b0(weights=None).eval()
    inputs = (torch.rand(1, 3, 64, 64),)
    planted = plant_overflow(model, inputs)
    assert not torch.isfinite(run_half(planted, inputs)).all()
    assert _stored_beyond_fp16(planted)  # the planted batch norm's weight
    patched = patch(planted, watch_report(planted, inputs))
    the_plan = get_plan(patched)
    assert not the_plan.unresolved
    assert _stored_beyond_fp16(patched) == []
    assert torch.isfinite(run_half(patched, inputs)).all()
    # nine batch norms in their affine form (float64, rounded once): a few ulps of FP32
    assert relative_error(planted(*inputs), patched(*inputs)) <= 1e-5
    assert _island_types(planted, the_plan) <= {nn.SiLU}


@torch.no_grad()
def test_an_exit_that_cannot_hold_the_factor_becomes_a_scaled_island():
    """fc2 would store W x 128 (beyond FP16) and its output is the model's (no factor can
    follow): it runs in FP32, fed x 128, its parameters untouched."""
    model, inputs = huge_weight_head()
    assert not torch.isfinite(run_half(model, inputs)).all()
    patched = patch(model, watch_report(model, inputs))
    the_plan = get_plan(patched)
    [island] = the_plan.islands
    assert (island.module, island.in_scale, island.out_scale) == ("fc2", 128.0, 1.0)
    assert torch.equal(patched.fc2.weight, model.fc2.weight)
    assert _stored_beyond_fp16(patched) == []
    want = model(*inputs)
    assert relative_error(want, patched(*inputs)) <= 1e-6
    half = run_half(patched, inputs)
    assert torch.isfinite(half).all() and cosine(want, half) >= 0.999
