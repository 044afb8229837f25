"""The FP16 facts the code lives by."""

from __future__ import annotations

import math

FP16_MAX = 65504.0
"""Largest finite FP16 value."""
FP16_MIN_NORMAL = 2.0**-14
"""Smallest normal FP16 value (about 6.10e-5): below it precision is lost."""
FP16_MIN_SUBNORMAL = 2.0**-24
"""Smallest subnormal FP16 value (about 5.96e-8): below half of it a value becomes 0."""


def headroom_bits(absmax: float, limit: float = FP16_MAX) -> float:
    """log2(limit / absmax): how many doublings are left before the limit.

    Negative when the value is already beyond the limit; +inf for an all-zero tensor.
    """
    if absmax <= 0:
        return math.inf
    if not math.isfinite(absmax):
        return -math.inf
    return math.log2(limit / absmax)


def is_power_of_two(p: float) -> bool:
    """True for 2**k with integer k (negative k allowed)."""
    if not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
        return False
    mantissa, _ = math.frexp(p)
    return mantissa == 0.5


def half_step(magnitude: float) -> float:
    """Half the FP16 spacing at ``magnitude``: a change below it is lost to rounding when a
    value of that size is stored in FP16. 2^-25 (half the smallest subnormal step) at and
    below 2^-14; doubles with every binade above."""
    if not magnitude > FP16_MIN_NORMAL:
        return FP16_MIN_SUBNORMAL / 2
    if not math.isfinite(magnitude):
        return math.inf
    return 2.0 ** (math.floor(math.log2(magnitude)) - 11)
