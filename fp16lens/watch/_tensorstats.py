"""Statistics of op outputs, cheap enough to take on every op.

Per op output, two cheap things happen: one fused pass for the exact extremes
(``torch.aminmax``) and a copy of an evenly strided sample of at most ``sample_size``
elements. Once per forward call, all samples are reduced together (one histogram over
every event) into per-binade counts, zeros, non-finite and over-threshold counts.
"""

from __future__ import annotations

import math

import torch

from fp16lens.report import HIST_BINS, HIST_MIN_EXP

# layout of a per-event row returned by reduce_samples():
# HIST_BINS binade counts of non-zero finite values, then zeros, nonfinite, over threshold
S_ZEROS, S_NONFINITE, S_OVER = HIST_BINS, HIST_BINS + 1, HIST_BINS + 2
SAMPLE_LEN = HIST_BINS + 3


def extremes(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # flat: dense,
    # in memory order
    """(min, max) of a tensor as two 0-d tensors of its dtype on its device (NaN if it
    holds NaN): one kernel; ``stack_extremes`` gathers a forward's pairs in one more."""
    return torch.aminmax(flat)


def stack_extremes(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(n, 2) float32 on the pairs' device: one stack per dtype among the pairs (one in
    all for a model of one dtype), not one per op."""
    flat = [x for pair in pairs for x in pair]
    dtypes = {x.dtype for x in flat}
    if len(dtypes) == 1:
        return torch.stack(flat).float().view(-1, 2)
    out = torch.empty(len(flat), dtype=torch.float32, device=flat[0].device)
    for dtype in dtypes:
        at = [i for i, x in enumerate(flat) if x.dtype == dtype]
        out[torch.tensor(at, device=out.device)] = torch.stack([flat[i] for i in at]).float()
    return out.view(-1, 2)


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


def take_sample(flat: torch.Tensor, sample_size: int, run: int = 16) -> torch.Tensor:
    """A 1-D float32 copy of about ``sample_size`` elements (never a view): evenly spaced
    runs of ``run`` contiguous elements, so the copy touches few cache lines. ``flat``
    is contiguous (of any shape): its elements are read in memory order."""
    n = flat.numel()
    if n <= sample_size:
        return flat.as_strided((n,), (1,)).to(torch.float32, copy=True)
    runs = max(1, sample_size // run)
    stride = n // runs
    length = min(run, stride)
    return flat.as_strided((runs, length), (stride, 1)).to(torch.float32, copy=True).view(-1)


def _bin_table() -> torch.Tensor:
    """Row bin for key = 2 * biased exponent + (|v| != 0) of a float32 value."""
    table = torch.empty(512, dtype=torch.int64)
    for biased in range(256):
        table[2 * biased + 1] = min(max(biased - 126 - HIST_MIN_EXP, 0), HIST_BINS - 1)
        table[2 * biased] = S_ZEROS if biased == 0 else table[2 * biased + 1]
    table[511] = table[510] = S_NONFINITE
    return table


_BINS = _bin_table()


def reduce_samples(samples: list[torch.Tensor], threshold: float) -> torch.Tensor:
    """One row of SAMPLE_LEN counts per sample, computed in a few ops for all of them.

    The binade of each value comes from the bits of its float32 encoding: |v| in
    [2^(k-1), 2^k) has biased exponent k + 126 (FP32 subnormals land in bin 0); a
    512-entry table maps (biased exponent, non-zero) to the row's bin."""
    n = len(samples)
    s = torch.cat(samples)
    bits = s.view(torch.int32) & 0x7FFFFFFF  # |v|, bit for bit
    key = ((bits >> 23) << 1).add_(bits.clamp(max=1))
    width = SAMPLE_LEN - 1
    idx = _BINS.to(s.device).index_select(0, key)
    lengths = [x.numel() for x in samples]
    if len(set(lengths)) == 1:  # equal samples: the row offset is a reshape away
        idx = idx.view(n, lengths[0]).add_(
            torch.arange(0, n * width, width, device=s.device).view(n, 1)
        )
    else:
        marks = torch.zeros(s.numel(), dtype=torch.int64, device=s.device)
        starts = torch.tensor(lengths[:-1], device=s.device).cumsum_(0)
        marks[starts] = width
        idx += marks.cumsum_(0)
    counts = torch.bincount(idx.view(-1), minlength=n * width).view(n, width)
    # values past the threshold can only sit in its binade or above (or be inf)
    top = min(max(math.frexp(threshold)[1] - HIST_MIN_EXP, 0), HIST_BINS - 1)
    if bool(counts[:, top:HIST_BINS].any()) or bool(counts[:, S_NONFINITE].any()):
        over = bits.view(torch.float32) > threshold
        rows = torch.repeat_interleave(
            torch.arange(n, device=s.device), torch.tensor(lengths, device=s.device)
        )
        extra = torch.bincount(rows[over], minlength=n)
    else:
        extra = torch.zeros_like(counts[:, 0])
    return torch.cat([counts, extra.view(n, 1)], dim=1)
