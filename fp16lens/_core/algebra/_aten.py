"""Functional ops by their aten name, as watch names them (``add``, ``convolution``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction

from fp16lens._core.algebra._classes import Kind, OpClass
from fp16lens._core.underflow import SINGULAR_NAMES

_ABSORBING = frozenset({
    "convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "batch_norm",
})  # fmt: skip
_INVARIANT = frozenset({"layer_norm", "group_norm", "instance_norm", "rms_norm"})
_HOMOGENEOUS = frozenset({
    "relu", "leaky_relu", "prelu", "_prelu_kernel", "prelu_kernel", "identity", "dropout",
    "native_dropout", "feature_dropout", "alpha_dropout", "max_pool1d", "max_pool2d",
    "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d",
    "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "upsample", "interpolate", "flatten", "unflatten", "neg",
    "pixel_shuffle", "pixel_unshuffle", "mean", "sum", "amax", "amin", "max", "min", "abs",
})  # fmt: skip
DEGREES = {
    "pow": Fraction(2),
    "square": Fraction(2),
    "sqrt": Fraction(1, 2),
    "rsqrt": Fraction(-1, 2),
}
"""Ops homogeneous of a degree other than 1: f(px) = p^d f(x). ``pow`` with one tensor
producer is ``x ** k`` for a number k; a report names the op, not k, so it is taken as the
square (``x ** 2``, ``torch.square``, ``x.pow(2)``: what magnitudes and variances use) and
patch's FP32 check on the rewritten model rejects any other exponent."""
JOINS = frozenset({"add", "sub", "cat", "concat", "stack", "maximum", "minimum"})
"""Ops that combine several tensors elementwise or by concatenation: equal scales in."""
PRODUCTS = frozenset({"mul"})
"""Products x * g: the scale of x passes when g is computed from x behind an absorbing layer."""


SINGULAR = SINGULAR_NAMES
"""Ops that blow up as their input nears 0 (``log``, ``1/x``, ``x ** -k``; a quotient's
denominator): small values they read must not be flushed or made subnormal by a scale.
Lower-cased, so ONNX's ``Log``, ``Reciprocal``, ``Div``, ``Pow`` are the same names (one
table with the underflow check's: ``_core/underflow.py``)."""


def is_singular(op: str) -> bool:
    return _key(op) in SINGULAR


def degree(op: str) -> Fraction:
    """The degree d of a homogeneous op: f(px) = p^d f(x) (1 unless in ``DEGREES``)."""
    return DEGREES.get(_key(op), Fraction(1))


def _key(op: str) -> str:
    return op.lower().removesuffix("_")  # "relu_" (in place) is "relu"


def is_join(op: str) -> bool:
    return _key(op) in JOINS


def product_carrier(site: str, producers: Mapping[str, Sequence[str]]) -> str | None:
    """The operand of a two-operand product that carries its scale onward, or None.

    In x * g(x) (a squeeze-excitation gate) x is an ancestor of the other operand g: with x
    divided by p, g's first absorbing layer takes p back, g is unscaled and the product
    carries x's 1/p. Whether g really is unscaled is the planner's check (its class must
    carry no scale and must not hold x). Neither operand an ancestor of the other: None.
    """
    ops = list(dict.fromkeys(producers.get(site, ())))
    if len(ops) != 2:
        return None
    a, b = ops
    a_up, b_up = _upstream(b, a, producers), _upstream(a, b, producers)
    return a if a_up and not b_up else b if b_up and not a_up else None


def _upstream(site: str, target: str, producers: Mapping[str, Sequence[str]]) -> bool:
    """True when ``target`` is an ancestor of ``site`` in the dataflow."""
    seen, todo = {site}, [site]
    while todo:
        for p in producers.get(todo.pop(), ()):
            if p == target:
                return True
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return False


def is_product(op: str) -> bool:
    return _key(op) in PRODUCTS


def aten_class(op: str) -> OpClass | None:
    """The class of an aten op name; None when the name is not one the algebra knows."""
    key = _key(op)
    if key in _ABSORBING:
        return OpClass.ABSORBING
    if key in _INVARIANT:
        return OpClass.INVARIANT
    if key in _HOMOGENEOUS or key in JOINS or key in DEGREES or key.startswith("upsample_"):
        return OpClass.HOMOGENEOUS
    return None


def op_kind(op: str, producers: int, params: bool = False) -> Kind:
    """What patch can do at functional op ``op`` with ``producers`` tensor producers.

    A join fed by one tensor adds a constant (or the tensor to itself): no scale passes.
    An absorbing op absorbs only where its weight is a parameter patch can reach
    (``params``: a GraphModule's conv/linear); a functional norm's eps cannot be changed.
    A power (``DEGREES``) passes a scale p as p^d when one tensor feeds it (``pow(x, t)``
    with a tensor exponent t from the model is opaque).
    Everything else that is not homogeneous (mul, div, unknown ops) is opaque.
    """
    if is_join(op):
        return Kind.JOIN if producers >= 2 else Kind.OPAQUE
    if _key(op) in DEGREES:
        return Kind.POWER if producers == 1 else Kind.OPAQUE
    cls = aten_class(op)
    if cls is OpClass.HOMOGENEOUS:
        return Kind.HOMOG
    if cls is OpClass.ABSORBING and params:
        return Kind.LINEAR
    return Kind.OPAQUE
