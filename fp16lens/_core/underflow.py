"""Underflow that breaks: the FP16 facts and the table behind the ``underflow`` mechanism
(pure: numbers and op names, no tensors).

FP16 rounds |v| <= 2^-25 to 0 (half the smallest subnormal, ties to even). A zero is
harmless almost everywhere (a ReLU output, a conv input), but some ops are *singular* at
0: log(0) = -inf, x/0 = inf and 0/0 = NaN, rsqrt(0) = inf, 0^-k = inf. A value that is
small but non-zero in FP32 and 0 in FP16 — an ``exp`` of a large negative number, a
square of a small one, a mean of those — turns finite FP32 results into inf/NaN there.
An eps or clip bound meant to keep the operand away from 0 (``clamp(min=1e-8)``,
``x + 1e-10``) is itself 0 in FP16 when it is that small, and protects nothing.
"""

from __future__ import annotations

import math

FLUSH = 2.0**-25
"""At or below this magnitude a value is 0 in FP16 (round to nearest even)."""

# aten op (display name) -> which positional argument is singular at 0
SINGULAR_ARG: dict[str, int] = {
    "log": 0,
    "log2": 0,
    "log10": 0,
    "reciprocal": 0,
    "rsqrt": 0,
    "div": 1,  # the denominator (true_divide is div in aten)
    "pow": 0,  # only with a negative exponent (see ``singular_pow``)
    "atan2": 0,  # only where both operands are 0 (see ``SINGULAR_BOTH``)
}
SINGULAR_BOTH = frozenset({"atan2"})
"""Ops singular only where every operand is 0: atan2(0, 0) = 0 in FP16 where FP32 gives
the angle of two tiny values (a phase of a quiet spectrum bin): wrong, not non-finite."""
SINGULAR_OPS = frozenset(SINGULAR_ARG)

# ONNX op type -> the input slot where 0 is singular (Pow: with a negative exponent)
ONNX_SINGULAR_ARG: dict[str, int] = {"Log": 0, "Div": 1, "Reciprocal": 0, "Pow": 0}
SINGULAR_WHAT: dict[str, str] = {
    "log": "log(0) = -inf",
    "log2": "log(0) = -inf",
    "log10": "log(0) = -inf",
    "div": "x/0 = inf, 0/0 = NaN",
    "reciprocal": "1/0 = inf",
    "rsqrt": "rsqrt(0) = inf",
    "pow": "0 to a negative power = inf",
    "atan2": "atan2(0, 0) = 0 instead of the angle",
}
"""What a 0 gives at each singular op (aten names; an ONNX op type lower-cased)."""
SINGULAR_NAMES = frozenset(
    {*SINGULAR_ARG, "true_divide", *(op.lower() for op in ONNX_SINGULAR_ARG)}
)
"""Every name of an op singular at 0, lower-cased: aten's and ONNX's (``Log`` is ``log``)."""
# ONNX nodes that keep values off 0 with a constant (an eps added, a Max/Clip bound), and
# nodes that keep a zero a zero (a sum or mean of values FP16 flushed is 0 where all were)
ONNX_GUARDS = ("Add", "Sub", "Max", "Min", "Clip")
ONNX_ZERO_KEEPING = (
    "Sqrt",
    "Abs",
    "Identity",
    "Relu",
    "Reshape",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Transpose",
    "ReduceSum",
    "ReduceMean",
    "ReduceSumSquare",
    "ReduceL2",
)


def is_singular_name(op: str) -> bool:
    """Whether ``op`` (an aten display name or an ONNX op type) is singular at 0."""
    return op.split(".")[0].lower() in SINGULAR_NAMES


# ops whose output is 0 where their (first) operand is 0, elementwise: a zero FP16 made
# upstream stays a zero through them (sqrt of a flushed variance is still 0)
ZERO_KEEPING = frozenset(
    {
        "sqrt",
        "abs",
        "neg",
        "relu",
        "square",
        "mul",
        "div",
        "clamp",
        "clamp_min",
        "pow",
        "hardtanh",
        "leaky_relu",
    }
)
# reductions that are 0 where every reduced value is 0: a row of flushed exps sums to 0
ZERO_REDUCING = frozenset({"sum", "mean", "linalg_vector_norm", "norm", "amax", "nansum"})
# ops whose output is 0 only where every operand is 0
ZERO_JOINING = frozenset({"add", "sub", "maximum", "hypot"})

# how the singular op turns a zero into a non-finite value, for the report
RESULT = {
    "log": "log(0) = -inf",
    "log2": "log2(0) = -inf",
    "log10": "log10(0) = -inf",
    "reciprocal": "1/0 = inf",
    "rsqrt": "rsqrt(0) = inf",
    "div": "x/0 = inf, 0/0 = NaN",
    "pow": "0^-k = inf",
    "atan2": "atan2(0, 0) = 0 instead of the angle",
}


def flushes(value: float) -> bool:
    """Whether a non-zero constant is 0 in FP16."""
    return value != 0 and abs(value) <= FLUSH and math.isfinite(value)


def singular_pow(exponent) -> bool:
    """pow(x, e) is singular at x = 0 for a negative number e."""
    return isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent < 0


def describe(op: str, site: str, origin: str, const: str, share: float, count: int) -> str:
    """One sentence naming the op where the value becomes non-finite, the site where
    the values flushed and the constant that vanished."""
    what = RESULT.get(op, "a zero is singular")
    where = (
        f"values that flush to 0 in FP16 at {origin}"
        if origin
        else "values that flush to 0 in FP16"
    )
    gone = f"; {const} meant to keep it away from 0 is itself 0 in FP16" if const else ""
    wrong = "are wrong (0)" if op in SINGULAR_BOTH else "become inf/NaN"
    return (
        f"{site} ({op}) receives {where} ({100 * share:.3g}% of its operand){gone}: "
        f"{what}, so ~{count} values {wrong} in FP16 while FP32 is finite"
    )


def advice(op: str, origin: str, const: str) -> str:
    """The fix in words (what patch does)."""
    block = f"from {origin} through the {op}" if origin else f"the {op} and what feeds it"
    eps = (
        f"; or raise {const} to at least 2^-24 ≈ 6e-8 (1e-7 or more survives FP16)" if const else ""
    )
    return (
        f"scale the flushing values up by 2^k before they are stored where the {op} ends the "
        "scale exactly (a log adds k·log 2 for the next bias to take back, a ratio cancels it, "
        "a power carries it to the next layer: patch does this in PyTorch models, rules "
        f"underflow-log/-ratio/-power), else run the normalization block {block} in FP32 "
        f"(patch makes it one FP32 island){eps}"
    )
