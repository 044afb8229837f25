"""The exact rules for underflow that breaks (docs/DESIGN.md, "the rescaling algebra").

Overflow divides a region by p = 2^k; underflow multiplies one by 2^j so that the values
FP16 flushes (a square of a quiet signal, a mean of those) are stored as ordinary numbers.
A value in such a region carries a *power* w: it is 2^(j w) times its FP32 self. The
power passes through ops homogeneous of degree 1 (views, sums, means, abs, relu, a
multiply by a number), is multiplied by the degree of a power (x*x: 2w, sqrt: w/2, rsqrt:
-w/2, reciprocal: -w, pow(x, a): a w), adds up in a product and subtracts in a quotient.
A guard constant joined to a scaled value (an eps added, a clamp bound) is scaled with it:
2^(j w) (y + eps) = 2^(j w) y + 2^(j w) eps, exact for a power of two. The scale ends

- at a ``log`` (rule ``underflow-log``): log(2^s y) = log y + s log 2, an additive constant
  that the next bias (an add of a number, a Linear's bias) absorbs, or one subtraction;
- at a quotient or atan2 of two equally scaled operands (rule ``underflow-ratio``): the
  factor cancels (x / sum(x), x / sqrt(mean(x^2)), x * rsqrt(mean(x^2)));
- after a power (rule ``underflow-power``): rsqrt/sqrt/reciprocal/pow(x, -a) carry 2^(j w a)
  to the next absorbing op (a Linear/Conv weight times 2^(-j w)) or one exact multiply.

j is chosen so that every scaled value stays at or under 2^14 (a binade under 65504 for
louder inputs than the recorded ones: the same margin as overflow's factor) and the values
that flushed land at or above 2^-20 (sixteen subnormal steps: at most 3% rounding); where
no j does both, or an op outside this table reads a scaled value, patch keeps the FP32
island of the block. Pure: names and numbers; patch applies it (``patch/_underflow_rules.py``).
"""

from __future__ import annotations

import math
from fractions import Fraction

RULE_LOG = "underflow-log"
RULE_RATIO = "underflow-ratio"
RULE_POWER = "underflow-power"
RULE_ISLAND = "FP32 island of the block"

PEAK_EXP = 14
"""A scaled value's largest |value| stays at or under 2^PEAK_EXP."""
LIFT_EXP = -20
"""A lifted value lands at or above 2^LIFT_EXP (16 steps of FP16's subnormal 2^-24)."""

SAME = frozenset({
    "view", "reshape", "permute", "transpose", "flatten", "unflatten", "unsqueeze", "squeeze",
    "contiguous", "expand", "expand_as", "clone", "getitem", "flip", "roll", "narrow", "select",
    "sum", "mean", "amax", "amin", "abs", "neg", "relu", "std", "norm", "vector_norm",
    "linalg_vector_norm", "avg_pool1d", "avg_pool2d", "max_pool1d", "max_pool2d", "pad", "float",
    "to", "type_as", "detach", "cumsum", "nansum", "max_pool3d", "avg_pool3d", "repeat", "tile",
})  # fmt: skip
"""Degree 1: f(2^s x) = 2^s f(x), the power passes unchanged."""
VIEWS = frozenset({
    "view", "reshape", "permute", "transpose", "flatten", "unflatten", "unsqueeze", "squeeze",
    "contiguous", "expand", "expand_as", "clone", "getitem", "float", "to", "type_as", "detach",
    "narrow", "select", "flip", "roll",
})  # fmt: skip
"""Ops watch records as no site of their own (their values are their input's)."""
POWERS = {
    "sqrt": Fraction(1, 2),
    "rsqrt": Fraction(-1, 2),
    "reciprocal": Fraction(-1),
    "square": Fraction(2),
    "var": Fraction(2),
}
"""Ops homogeneous of another degree: the power is multiplied by it."""
LOG_BASE = {"log": math.e, "log2": 2.0, "log10": 10.0}
JOINS = frozenset({"add", "sub", "maximum", "minimum", "cat", "stack", "hypot"})
"""Operands of equal power (a number joined is a guard: scaled with them)."""
GUARDS = frozenset({"add", "sub", "clamp", "clamp_min", "clamp_max", "maximum", "minimum"})
RATIO = frozenset({"div", "atan2"})
"""Quotients: the power of the numerator minus the denominator's (atan2: equal powers, 0)."""
PRODUCTS = frozenset({"matmul", "mm", "bmm"})
"""Bilinear: the powers of the two operands add (a filterbank buffer is at power 0)."""
REDUCTIONS = frozenset(
    {
        "sum",
        "mean",
        "std",
        "var",
        "norm",
        "vector_norm",
        "linalg_vector_norm",
        "amax",
        "nansum",
        "cumsum",
    }
)
"""A reduction of values FP16 flushed is 0 where FP32 lifts it: its own low values must lift."""

_ALIASES = {
    "truediv": "div",
    "true_divide": "div",
    "itruediv": "div",
    "clip": "clamp",
    "iadd": "add",
    "imul": "mul",
    "isub": "sub",
    "radd": "add",
    "rmul": "mul",
}


def op_name(name: str) -> str:
    """An op's name in this table (``log_`` is ``log``, ``truediv`` is ``div``)."""
    key = name.lower().removeprefix("__").removesuffix("__").removesuffix("_")
    return _ALIASES.get(key, key)


_FAMILY = {"matmul": "mm", "bmm": "mm", "clamp_min": "clamp", "square": "pow"}


def family(name: str) -> str:
    """The name an op and its aten forms share (``matmul`` runs ``mm`` or ``bmm``;
    ``clamp(min=)`` may run ``clamp_min``): for lining up fx nodes with a report's sites."""
    return _FAMILY.get(name, name)


def exponent_of(value) -> Fraction | None:
    """A number as a small fraction (pow's exponent), None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    f = Fraction(value).limit_denominator(16)
    return f if float(f) == float(value) else None


def log_offset(op: str, shift: Fraction) -> float:
    """log_b(2^shift y) - log_b(y): what a log adds for an operand at 2^shift."""
    return float(shift) * math.log(2.0) / math.log(LOG_BASE[op])


def rule_name(singular: str, scaled_operands: int) -> str:
    """The rule that ends the scale at the singular op: a log adds a constant, a quotient of
    two scaled operands cancels it, anything else carries a power onward."""
    op = op_name(singular)
    if op in LOG_BASE:
        return RULE_LOG
    if op in RATIO and scaled_operands >= 2:
        return RULE_RATIO
    return RULE_POWER


def exponent_range(demands: list[tuple[float, Fraction]]) -> tuple[int, int]:
    """(lowest, highest) j keeping every (peak, power) at or under 2^PEAK_EXP after the
    scale 2^(j w): a positive power bounds j from above, a negative one from below."""
    lo, hi = 1, 64
    for peak, w in demands:
        if not (peak > 0 and math.isfinite(peak)) or w == 0:
            continue
        room = PEAK_EXP - math.log2(peak)
        if w > 0:
            hi = min(hi, math.floor(room / float(w)))
        else:
            lo = max(lo, math.ceil(-room / float(-w)))
    return lo, hi


def lifted(low: float, w: Fraction, j: int) -> bool:
    """Whether a value ``low`` at power ``w`` lands at or above 2^LIFT_EXP once scaled."""
    return low > 0 and math.log2(low) + float(w) * j >= LIFT_EXP


def step_of(powers) -> int:
    """j must be a multiple of this for every 2^(j w) to be a power of two (rsqrt: even)."""
    return math.lcm(1, *(Fraction(w).denominator for w in powers))
