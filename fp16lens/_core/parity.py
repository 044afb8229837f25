"""Parity measures shared by ``verify`` (a file against its reference) and ``export`` (an
INT8 target): one definition, so a threshold means the same in both."""

from __future__ import annotations

import math

import numpy as np

from fp16lens._core.fp16 import FP16_MAX


def sqnr_db(signal_sq: float, noise_sq: float) -> float:
    """10 log10(signal / noise) from the sums of squares: inf where the noise is 0, -inf
    where it is not finite or the signal is 0 (and the noise is not)."""
    if not math.isfinite(noise_sq):
        return -math.inf
    if noise_sq == 0:
        return math.inf
    if signal_sq == 0:
        return -math.inf
    return 10.0 * math.log10(signal_sq / noise_sq)


def cosine(dot: float, a_sq: float, b_sq: float) -> float:
    """Cosine similarity from sums; NaN when a sum is not finite; 1 for two zeros."""
    if not all(math.isfinite(v) for v in (dot, a_sq, b_sq)):
        return math.nan
    if a_sq == 0 and b_sq == 0:
        return 1.0
    if a_sq == 0 or b_sq == 0:
        return 0.0
    return max(-1.0, min(1.0, dot / math.sqrt(a_sq * b_sq)))


VARIES = 0.9999
"""The reference's own values rounded to FP16 keep at least this cosine about its mean
(``about_mean``) where an output varies enough for that cosine to say something: a value
like 1000.0001 +- 1e-4 varies below what any FP16 or INT8 output can hold."""


def about_mean(n: int, ref_sum: float, cand_sum: float, dot: float, ref_sq: float, cand_sq: float):
    """The cosine of a candidate against its reference, both taken about the reference's
    mean, from the sums over their ``n`` values (``dot`` = sum ref*cand). A plain cosine
    cannot see an error small beside a shared offset: scores of 2.5 to 4 off by 0.12 keep a
    cosine of 0.9997, while about their mean they keep 0.97. A constant error (a bias)
    counts, since the candidate is centred on the reference's mean, not its own. None
    where the reference does not vary (one value, or the same value throughout)."""
    if n == 0 or not all(math.isfinite(v) for v in (ref_sum, ref_sq)):
        return None
    mu = ref_sum / n
    spread = ref_sq - n * mu * mu
    if not spread > 1e-12 * ref_sq:  # no variation above the sums' own rounding
        return None
    return cosine(dot - mu * cand_sum, spread, max(cand_sq - 2 * mu * cand_sum + n * mu * mu, 0.0))


def about_mean_of(ref, cand) -> float | None:
    """``about_mean`` of two arrays of one size; None also where ``ref`` varies by less
    than FP16 holds of it (its own values rounded to FP16 keep less than ``VARIES``)."""
    r = np.asarray(ref, np.float64).ravel()
    c = np.asarray(cand, np.float64).ravel()
    h = np.clip(r, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float64)
    sums = (r.size, float(r.sum()))
    held = about_mean(*sums, float(h.sum()), float(r @ h), float(r @ r), float(h @ h))
    if held is None or not held >= VARIES:
        return None
    return about_mean(*sums, float(c.sum()), float(r @ c), float(r @ r), float(c @ c))
