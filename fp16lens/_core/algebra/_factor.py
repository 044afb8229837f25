"""Choosing a scale: pure arithmetic on a region's ranges, shared by advice and patch."""

from __future__ import annotations

import math
from fractions import Fraction

from fp16lens._core.fp16 import FP16_MAX, FP16_MIN_NORMAL

TARGET_EXP = 13
"""A rescaled peak lands near 2^13: 3 binades below 65504 (PatchOptions.target's default)."""


def rescale_exponent(peak: float, power: int = 1) -> int | None:
    """k = ceil(log2(peak / 2^13) / power), at least 1; None for inf/NaN peaks.

    ``power`` is 2 when the quantity is a square of the input ((x-mean)^2, x^2): a
    2^-k input scale divides it by 4^k.
    """
    if not math.isfinite(peak) or peak <= 0:
        return None
    return max(1, math.ceil((math.log2(peak) - TARGET_EXP) / power))


def pow2_ceil(x: float) -> float:
    """Smallest power of two >= x (at least 1)."""
    return 1.0 if x <= 1 else 2.0 ** math.ceil(math.log2(x))


def pow2_floor(x: float) -> float:
    """Largest power of two <= x (at least 1)."""
    return 1.0 if x <= 1 else 2.0 ** math.floor(math.log2(x))


def needed(demands: list[tuple[float, int | Fraction]], limit: float) -> float:
    """Smallest factor bringing every demand under ``limit``: value / p^power <= limit."""
    return max(((v / limit) ** (1.0 / k) for v, k in demands), default=1.0)


def choose_factor(demands: list[tuple[float, int | Fraction]], low: float, target: float) -> float:
    """A power of two that puts every demand under ``target`` (about 2^13), lowered when
    that would push ``low`` (the region's small significant values) under 2^-14, but never
    below what keeps every demand under half the FP16 limit. At least 2."""
    p_target = pow2_ceil(needed(demands, target))
    p_safe = pow2_ceil(needed(demands, FP16_MAX / 2))
    p_low = pow2_floor(low / FP16_MIN_NORMAL) if 0 < low < math.inf else math.inf
    p = p_target if p_target <= p_low else max(p_safe, p_low)
    return max(p, 2.0)


def exact_powers(p: float, exponents: list[Fraction]) -> float:
    """The smallest power of two 2^k >= ``p`` whose powers p^w for every exponent w of a
    class stay exact powers of two (k w an integer: sqrt's input an even power of two)."""
    step = math.lcm(1, *(Fraction(w).denominator for w in exponents))
    k = math.ceil(math.log2(pow2_ceil(p)) / step) * step
    return 2.0**k
