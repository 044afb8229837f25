"""Number and path formatting shared by the rendering, the advice and the plot (pure)."""

from __future__ import annotations

import math

from fp16lens._core import FP16_MAX

LOG2_MAX = math.log2(FP16_MAX)  # ~16.0
LOG2_MIN_NORMAL = -14.0
BAR_LOW = LOG2_MIN_NORMAL  # a bar is empty at the smallest normal, full at 65504


def value(v: float) -> str:
    """3 significant digits, short exponents: 271955.25 -> "2.72e5", 0.756 -> "0.756"."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    text = f"{v:.3g}"
    if "e" in text:
        mant, exp = text.split("e")
        text = f"{mant}e{int(exp)}"
    return text


def bits(h: float) -> str:
    """Headroom in bits with a sign: "+9.3", "-2.1", "inf" (all zero), "-inf" (inf/NaN)."""
    if math.isinf(h):
        return "inf" if h > 0 else "-inf"
    return f"{h:+.1f}"


def share_of_limit(absmax: float) -> str:
    """absmax as a share of 65504: "76%", "415%", "<1%", "inf"."""
    if not math.isfinite(absmax):
        return "inf"
    pct = 100.0 * absmax / FP16_MAX
    if 0 < pct < 1:
        return "<1%"
    return f"{pct:.0f}%"


def bar_fill(absmax: float, width: int) -> int:
    """Cells of a log2 bar from 2^-14 (empty) to 65504 (full); beyond the limit: full."""
    if absmax <= 0:
        return 0
    if not math.isfinite(absmax) or absmax >= FP16_MAX:
        return width
    frac = (math.log2(absmax) - BAR_LOW) / (LOG2_MAX - BAR_LOW)
    return max(0, min(width, round(frac * width)))


def log2_abs(v: float) -> float:
    """log2 |v|, +inf for inf/NaN, -inf for 0 (the plot clips both)."""
    if not math.isfinite(v):
        return math.inf
    return math.log2(abs(v)) if v else -math.inf


def collapse(names: list[str], keep: int) -> list[str]:
    """At most ``keep`` names: the head and the tail, the middle as "… N more …"."""
    if len(names) <= keep:
        return list(names)
    tail = max(1, (keep - 1) // 2)
    head = keep - 1 - tail
    return [*names[:head], f"… {len(names) - head - tail} more …", *names[-tail:]]


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def limit(report) -> str:
    """The limit spans are judged by, in words: ±65504, or a lower --threshold named as one."""
    threshold = report.meta.threshold
    if threshold < FP16_MAX:
        return f"±{threshold:g} (the threshold, a margin below FP16's 65504)"
    return "±65504"
