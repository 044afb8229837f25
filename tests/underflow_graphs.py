"""Small ONNX graphs (built with onnx.helper) where values FP16 flushes to 0 reach a node
where 0 is singular, with the inputs that make them break, and clean controls: shared by
the underflow tests of watch and patch."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def _const(name: str, value) -> object:
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def _model(nodes, inits, shape=(4, 16), out_shape=None):
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, list(shape))],
        [helper.make_tensor_value_info("y", F, list(out_shape or shape))],
        initializer=inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _square_eps(eps: float) -> list:
    return [
        helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
        helper.make_node("Add", ["sq", "eps"], ["den"], name="add_eps"),
    ]


def log_eps(eps: float = 1e-10):
    """log(x² + eps): the log-spectrogram front end."""
    return _model(
        [*_square_eps(eps), helper.make_node("Log", ["den"], ["y"], name="log")],
        [_const("eps", eps)],
    )


def sqrt_div(eps: float = 1e-12):
    """x / sqrt(x² + eps)."""
    return _model(
        [
            *_square_eps(eps),
            helper.make_node("Sqrt", ["den"], ["rt"], name="sqrt"),
            helper.make_node("Div", ["x", "rt"], ["y"], name="div"),
        ],
        [_const("eps", eps)],
    )


def reciprocal(eps: float = 1e-10):
    return _model(
        [*_square_eps(eps), helper.make_node("Reciprocal", ["den"], ["y"], name="recip")],
        [_const("eps", eps)],
    )


def pow_neg(eps: float = 1e-10):
    """(x² + eps)^-0.5: an rsqrt."""
    return _model(
        [*_square_eps(eps), helper.make_node("Pow", ["den", "e"], ["y"], name="rsqrt")],
        [_const("eps", eps), _const("e", -0.5)],
    )


def softmax_by_hand():
    """exp(x) / Σ exp(x), written without the max subtraction."""
    return _model(
        [
            helper.make_node("Exp", ["x"], ["e"], name="exp"),
            helper.make_node("ReduceSum", ["e", "axes"], ["s"], name="sum", keepdims=1),
            helper.make_node("Div", ["e", "s"], ["y"], name="div"),
        ],
        [numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )


def lp_norm():
    return _model(
        [
            helper.make_node("Mul", ["x", "k"], ["small"], name="scale"),
            helper.make_node("LpNormalization", ["small"], ["y"], name="lpnorm", axis=1, p=2),
        ],
        [_const("k", 1e-4)],
    )


def square_into_conv(eps: float = 1e-10):
    """The same flushing x² + eps, read by a Conv: no singular node, nothing breaks."""
    w = np.random.default_rng(0).standard_normal((2, 1, 3)).astype(np.float32)
    return _model(
        [
            *_square_eps(eps),
            helper.make_node("Conv", ["den", "w"], ["y"], name="conv", pads=[1, 1]),
        ],
        [_const("eps", eps), _const("w", w)],
        shape=(4, 1, 16),
        out_shape=(4, 2, 16),
    )


def quiet(shape=(4, 16), seed: int = 0):
    """A quiet signal: |x| from 1e-6 to 1, so part of x² is below FP16's 2^-24."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-6, 0, shape)
    return (mag * rng.choice([-1, 1], shape)).astype(np.float32)


def div_no_nan(eps: float = 1e-10):
    """TensorFlow's div_no_nan of x by x² + eps: Where(den == 0, 0, x / den)."""
    return _model(
        [
            *_square_eps(eps),
            helper.make_node("Div", ["x", "den"], ["q"], name="div"),
            helper.make_node("Equal", ["den", "zero"], ["is0"], name="is_zero"),
            helper.make_node("Where", ["is0", "zero", "q"], ["y"], name="where"),
        ],
        [_const("eps", eps), _const("zero", 0.0)],
    )


def log_clip(bound: float = 1e-12):
    """log(max(x², bound)): the clip-bound form of the guard (torch.clamp_min exported)."""
    return _model(
        [
            helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
            helper.make_node("Max", ["sq", "lo"], ["den"], name="clamp"),
            helper.make_node("Log", ["den"], ["y"], name="log"),
        ],
        [_const("lo", bound)],
    )
