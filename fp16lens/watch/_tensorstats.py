"""Statistics of one tensor, cheap enough to take on every op output.

The maximum |v| is exact and costs one fused pass (``torch.aminmax``). Underflow
shares and the per-binade histogram come from an evenly strided sample of at most
``sample_size`` elements, so their cost does not grow with the tensor.
"""

from __future__ import annotations

import torch

from fp16lens._core import FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL
from fp16lens.report._model import HIST_BINS, HIST_MIN_EXP

# layout of the per-call sample vector returned by sample_stats()
S_SAMPLED, S_ZEROS, S_SUBNORMAL, S_UNDERFLOW, S_OVER, S_NONFINITE = range(6)
SAMPLE_FIELDS = 6


def absmax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a 0-d float32 tensor on t's device (NaN if t holds NaN)."""
    lo, hi = torch.aminmax(t.detach())
    return torch.maximum(hi, -lo).float()


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over t's elements without a copy when t is dense (any memory format)."""
    if t.is_contiguous():
        return t.reshape(-1)
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    p = t.permute(order)
    return p.reshape(-1) if p.is_contiguous() else t.reshape(-1)


def sample_stats(t: torch.Tensor, sample_size: int, threshold: float) -> torch.Tensor:
    """Counts and the binade histogram on a strided sample, as one float64 vector:
    [sampled, zeros, subnormal, underflow, over, nonfinite, hist...]. No host sync."""
    flat = flat_view(t.detach())
    step = max(1, flat.numel() // sample_size)
    s = flat[::step].float().abs()
    finite = torch.isfinite(s)
    nz = (s > 0) & finite
    exp = torch.frexp(s)[1] - HIST_MIN_EXP
    idx = exp.clamp_(0, HIST_BINS - 1).long()
    hist = torch.bincount(idx, weights=nz.double(), minlength=HIST_BINS)
    head = torch.stack(
        [
            torch.tensor(float(s.numel()), dtype=torch.float64, device=s.device),
            (s == 0).sum().double(),
            (nz & (s < FP16_MIN_NORMAL)).sum().double(),
            (nz & (s < FP16_MIN_SUBNORMAL)).sum().double(),
            (s > threshold).sum().double(),
            (~finite).sum().double(),
        ]
    )
    return torch.cat([head, hist])
