"""The built-in demo model, checked against real FP16 on the CPU (no fp16lens involved)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fp16lens.demo import OVERFLOW_SITE, SPAN_END, build_demo_model


def _leaf_outputs(model: nn.Module, inputs: tuple) -> list[tuple[str, torch.Tensor]]:
    """(name, output) of every leaf module, in execution order, with plain forward hooks."""
    names = {m: n for n, m in model.named_modules()}
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda mod, a, out: seen.append((names[mod], out.detach())))
        for m in model.modules()
        if not list(m.children())
    ]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_real_fp16_first_inf_is_layer4_bn2_while_fp32_is_finite():
    model, inputs = build_demo_model()
    fp32 = _leaf_outputs(model, inputs)
    assert all(torch.isfinite(out).all() for _, out in fp32)
    peaks = {name: out.abs().max().item() for name, out in fp32}
    assert peaks[OVERFLOW_SITE] > 65504  # FP32 is fine, but FP16 cannot hold it
    assert peaks[SPAN_END] < 65504  # the neck's batch norm brings the values back

    half = copy.deepcopy(model).half()
    fp16 = _leaf_outputs(half, tuple(x.half() for x in inputs))
    broken = [name for name, out in fp16 if not torch.isfinite(out).all()]
    assert broken[0] == OVERFLOW_SITE == "backbone.layer4.1.bn2"
    assert "head" in broken  # the damage reaches the output
    with torch.no_grad():
        assert not torch.isfinite(half(inputs[0].half())).all()


def test_every_weight_is_representable_and_the_build_is_deterministic():
    a, (xa,) = build_demo_model()
    b, (xb,) = build_demo_model()
    assert torch.equal(xa, xb) and xa.shape == (1, 3, 96, 96)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        assert p.abs().max().item() <= 65504, name  # only activations leave FP16 range
    assert not a.training
