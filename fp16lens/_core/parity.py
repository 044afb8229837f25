"""Parity measures shared by ``verify`` (a file against its reference) and ``export`` (an
INT8 target): one definition, so a threshold means the same in both."""

from __future__ import annotations

import math


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
