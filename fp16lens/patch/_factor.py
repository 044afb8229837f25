"""Choosing a region's factor: pure arithmetic on the report's ranges."""

from __future__ import annotations

import math

from fp16lens._core import FP16_MAX, FP16_MIN_NORMAL


def pow2_ceil(x: float) -> float:
    """Smallest power of two >= x (at least 1)."""
    return 1.0 if x <= 1 else 2.0 ** math.ceil(math.log2(x))


def pow2_floor(x: float) -> float:
    """Largest power of two <= x (at least 1)."""
    return 1.0 if x <= 1 else 2.0 ** math.floor(math.log2(x))


def needed(demands: list[tuple[float, int]], limit: float) -> float:
    """Smallest factor bringing every demand under ``limit``: value / p^power <= limit."""
    return max(((v / limit) ** (1.0 / k) for v, k in demands), default=1.0)


def choose_factor(demands: list[tuple[float, int]], low: float, target: float) -> float:
    """A power of two that puts every demand under ``target`` (about 2^13), lowered when
    that would push ``low`` (the region's small significant values) under 2^-14, but never
    below what keeps every demand under half the FP16 limit. At least 2."""
    p_target = pow2_ceil(needed(demands, target))
    p_safe = pow2_ceil(needed(demands, FP16_MAX / 2))
    p_low = pow2_floor(low / FP16_MIN_NORMAL) if 0 < low < math.inf else math.inf
    p = p_target if p_target <= p_low else max(p_safe, p_low)
    return max(p, 2.0)
