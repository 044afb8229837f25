"""Statistics of op outputs, cheap enough to take on every op.

Per op output, two cheap things happen: one fused pass for the exact extremes
(``torch.aminmax``) and a copy of an evenly strided sample of at most ``sample_size``
elements. Once per forward call, all samples are reduced together (one histogram over
every event) into per-binade counts, zeros, non-finite and over-threshold counts.
"""

from __future__ import annotations

import torch

from fp16lens.report._model import HIST_BINS, HIST_MIN_EXP

# layout of a per-event row returned by reduce_samples():
# HIST_BINS binade counts of non-zero finite values, then zeros, nonfinite, over threshold
S_ZEROS, S_NONFINITE, S_OVER = HIST_BINS, HIST_BINS + 1, HIST_BINS + 2
SAMPLE_LEN = HIST_BINS + 3


def extremes(flat: torch.Tensor) -> torch.Tensor:
    """(min, max) of a flat tensor as float32 on its device (NaN if it holds NaN).
    A 1-D input keeps aminmax on its fastest path."""
    lo, hi = torch.aminmax(flat)
    return torch.stack([lo, hi]).float()


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


def take_sample(flat: torch.Tensor, sample_size: int, run: int = 64) -> torch.Tensor:
    """A float32 copy of about ``sample_size`` elements (never a view): evenly spaced runs
    of ``run`` contiguous elements, so the copy touches few cache lines."""
    n = flat.numel()
    if n <= sample_size:
        return flat.to(torch.float32, copy=True)
    runs = max(1, sample_size // run)
    stride = n // runs
    length = min(run, stride)
    return flat.as_strided((runs, length), (stride, 1)).to(torch.float32, copy=True).reshape(-1)


def reduce_samples(samples: list[torch.Tensor], threshold: float) -> torch.Tensor:
    """One row of SAMPLE_LEN counts per sample, computed in a few ops for all of them."""
    n = len(samples)
    s = torch.cat(samples).abs_()
    lengths = torch.tensor([x.numel() for x in samples], device=s.device)
    seg = torch.repeat_interleave(torch.arange(n, device=s.device), lengths)
    idx = (torch.frexp(s)[1] - HIST_MIN_EXP).clamp_(0, HIST_BINS - 1)
    idx = torch.where(s == 0, S_ZEROS, idx)
    idx = torch.where(torch.isfinite(s), idx, S_NONFINITE)
    width = SAMPLE_LEN - 1
    counts = torch.bincount(seg * width + idx, minlength=n * width).view(n, width)
    over = torch.bincount(seg, weights=(s > threshold).double(), minlength=n).long()
    return torch.cat([counts, over.view(n, 1)], dim=1)
