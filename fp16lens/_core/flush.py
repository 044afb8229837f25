"""What storing a tensor in FP16 loses below the normal range (watch judges parameters by
it, export judges INT8/FP16 initializers by it): pure tensor math."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp16lens._core.fp16 import FP16_MIN_NORMAL


def small_as_fp16(a: torch.Tensor) -> torch.Tensor:
    """FP32 outputs as an FP16 output holds them below 2^-14 (a score of 1e-8 is 0 in any
    FP16 model: a cosine of 0 against it says nothing); elsewhere as they are. Patch's
    proof and verify compare through it."""
    return torch.where(a.abs() < FP16_MIN_NORMAL, a.half().to(a.dtype), a)


REL_STEP = 2.0**-11
"""FP16's relative rounding (half an ulp): what every normal FP16 weight already loses."""


@dataclass(frozen=True)
class FlushLoss:
    """What storing a tensor in FP16 loses through its values below 2^-14 (pure numbers).

    value: the largest change of one value (flushed: all of it; subnormal: the rounding).
    slice: the largest sum of those changes over one output channel (slices along axis 0
        in PyTorch's layout; a 1-D tensor's channels are its values).
    rel: the largest ``slice`` divided by that slice's sum of |w|.
    """

    value: float
    slice: float
    rel: float


def flush_loss(t: torch.Tensor, axes: tuple[int, ...] = (0,)) -> FlushLoss:
    """Pure: the loss FP16 makes in ``t`` below its normal range, per value and per slice
    (the worst over ``axes``, each taken as the output-channel axis)."""
    x = t.detach().float().reshape(t.shape if t.dim() else (1,))
    small = x.abs() < FP16_MIN_NORMAL
    err = torch.where(small, (x - x.half().float()).abs(), 0.0)
    lost, rel = 0.0, 0.0
    for axis in axes if x.dim() > 1 else (0,):
        other = [d for d in range(x.dim()) if d != axis % x.dim()]
        per = err.sum(other) if other else err
        mass = x.abs().sum(other) if other else x.abs()
        lost = max(lost, float(per.max()))
        rel = max(rel, float(torch.where(mass > 0, per / mass.clamp_min(1e-45), 0.0).max()))
    return FlushLoss(float(err.max()), lost, rel)


def percent(share: float) -> str:
    """A share as a percentage to three significant digits: losses just above FP16's
    rounding (2^-11, 0.049%) must not print as 0%."""
    return f"{100 * share:.3g}%"
