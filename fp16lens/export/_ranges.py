"""Range checks for weights that become FP16 (the thresholds watch uses for parameters)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fp16lens._core import FP16_MIN_NORMAL
from fp16lens.export._errors import ExportError


@dataclass(frozen=True)
class RangeIssues:
    """What converting one FP32 array to FP16 does to it."""

    absmax: float
    overflow: int  # becomes inf/NaN in FP16 (|v| >= 65520 after rounding, or already)
    subnormal: int  # non-zero values below 2**-14 in FP16 (precision lost), zeroed included
    zeroed: int  # non-zero values that round to 0


def range_issues(array: np.ndarray) -> RangeIssues:
    """Pure: what rounding ``array`` to FP16 does to it (judged on the rounded values)."""
    a = np.asarray(array, dtype=np.float32).ravel()
    if a.size == 0:
        return RangeIssues(0.0, 0, 0, 0)
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    zeroed = int(((a != 0) & (h == 0)).sum())
    return RangeIssues(
        absmax=float(np.abs(a).max()),
        overflow=int((~np.isfinite(h)).sum()),
        subnormal=int(((h != 0) & (np.abs(h) < FP16_MIN_NORMAL)).sum()) + zeroed,
        zeroed=zeroed,
    )


SATURATED = 1e30
"""Finite constants at or beyond this are masking constants (torch.finfo(float32).min)."""


def clamp_mask_constants(array: np.ndarray) -> tuple[np.ndarray, int]:
    """Clamp finite |v| >= 1e30 (masking constants) to +-65504, the FP16 equivalent of
    torch.finfo(float16).min that a .half() model would use; inf stays inf."""
    a = np.asarray(array)
    if not np.issubdtype(a.dtype, np.floating) or a.size == 0:
        return a, 0
    huge = np.isfinite(a) & (np.abs(a) >= SATURATED)
    n = int(huge.sum())
    if not n:
        return a, 0
    return np.where(huge, np.sign(a) * 65504.0, a).astype(a.dtype), n


def to_fp16_checked(
    name: str, array: np.ndarray, modules: list[str]
) -> tuple[np.ndarray, RangeIssues]:
    """``array`` as float16 and what the conversion does to it; ExportError on overflow.

    Masking constants (finite values >= 1e30, such as finfo(float32).min) are clamped to
    +-65504 rather than refused: converted as they are they would become inf, and
    ``(1 - mask) * -inf`` is NaN where the mask is 1."""
    array, _ = clamp_mask_constants(array)
    issues = range_issues(array)
    if issues.overflow:
        where = ", ".join(repr(m) for m in modules) or "the model"
        raise ExportError(
            f"weight {name!r} of {where} holds {issues.overflow} value(s) beyond FP16 "
            f"(|max| = {issues.absmax:.4g} > 65504). Rescale it with fp16lens.patch(), or keep "
            f"the module in FP32: export(..., fp32_modules=[{', '.join(repr(m) for m in modules)}])."
        )
    return np.asarray(array).astype(np.float16), issues


def subnormal_summary(entries: list[tuple[str, int, RangeIssues]], shown: int = 5) -> str | None:
    """One warning for all weights with subnormal values: (name, size, issues), worst share first."""
    hit = [(n, size, i) for n, size, i in entries if i.subnormal]
    if not hit:
        return None
    hit.sort(key=lambda e: e[2].subnormal / max(e[1], 1), reverse=True)
    parts = [f"{n} ({i.subnormal}/{size}, {i.zeroed} -> 0)" for n, size, i in hit[:shown]]
    more = f", and {len(hit) - shown} more" if len(hit) > shown else ""
    total = sum(i.subnormal for _, _, i in hit)
    zeroed = sum(i.zeroed for _, _, i in hit)
    return (
        f"{len(hit)} weight(s) hold {total} value(s) that are subnormal in FP16 (< 2^-14, "
        f"reduced precision; {zeroed} round to 0): {', '.join(parts)}{more}"
    )
