"""A few nodes of an ONNX graph re-evaluated with FP16 storage, from the FP32 values one
batch gave: each leaf (a node the replay does not evaluate, a graph input, a constant)
is rounded to FP16, each evaluated node computes in FP32 from FP16 operands and rounds its
output to FP16, as a real FP16 runtime stores it. The underflow check
(``watch/onnx/_underflow.py``) reads what the singular ops would see.

Pure numpy; a node whose recomputed shape differs from the FP32 one becomes a leaf, so a
case this file does not know only makes the replay shorter, never wrong about shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def to_fp16(a: np.ndarray) -> np.ndarray:
    """``a`` stored in FP16, as float32 (0 where FP16 flushes, inf where it overflows)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)


def attr(node, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            if a.type == a.INTS:
                return list(a.ints)
            if a.type == a.INT:
                return a.i
            if a.type == a.FLOAT:
                return a.f
    return default


def _axes(node, ins: list, ints: dict) -> list[int] | None:
    axes = attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        got = ints.get(node.input[1])
        if got is None:
            return None  # computed axes: not replayed
        axes = [int(a) for a in np.asarray(got).reshape(-1)]
    return axes


def _reduce(node, ins: list, ints: dict) -> np.ndarray | None:
    x = ins[0]
    axes = _axes(node, ins, ints)
    if not axes:
        if attr(node, "noop_with_empty_axes", 0):
            return x
        axes = list(range(x.ndim))
    dims = tuple(a % x.ndim for a in axes)
    keep = bool(attr(node, "keepdims", 1))
    op = node.op_type
    if op == "ReduceSumSquare":
        return np.sum(x * x, axis=dims, keepdims=keep)
    if op == "ReduceL2":
        return np.sqrt(np.sum(x * x, axis=dims, keepdims=keep))
    fns: dict[str, Callable[..., Any]] = {
        "ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max, "ReduceMin": np.min
    }  # fmt: skip
    return fns[op](x, axis=dims, keepdims=keep)


def _clip(node, ins: list) -> np.ndarray:
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else attr(node, "min")
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else attr(node, "max")
    x = ins[0]
    if lo is not None:
        x = np.maximum(x, lo)
    if hi is not None:
        x = np.minimum(x, hi)
    return x


_BINARY: dict[str, Callable[..., Any]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Pow": np.power,
}
_UNARY: dict[str, Callable[..., Any]] = {
    "Sqrt": np.sqrt,
    "Abs": np.abs,
    "Neg": np.negative,
    "Exp": np.exp,
    "Log": np.log,
    "Reciprocal": np.reciprocal,
    "Relu": lambda x: np.maximum(x, 0),
    "Identity": lambda x: x,
    "Softplus": lambda x: np.log1p(np.exp(x)),
}
_REDUCES = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL2")
_MOVES = ("Reshape", "Squeeze", "Unsqueeze", "Flatten")  # element order kept: the FP32 shape
FLOAT_INPUTS = {"Reshape": 1, "Squeeze": 1, "Unsqueeze": 1, "Flatten": 1, "Transpose": 1}
EVALUATED = frozenset((*_BINARY, *_UNARY, *_REDUCES, *_MOVES, "Transpose", "Max", "Min", "Clip"))


def evaluate(node, ins: list, ints: dict, shape: tuple | None) -> np.ndarray | None:
    """Node ``node`` on the operands ``ins`` (FP16-stored float32; None: an absent or
    non-float input), in float32; None when the node is not replayed."""
    op = node.op_type
    with np.errstate(all="ignore"):
        if op in _BINARY and len(ins) == 2 and ins[1] is not None:
            return _BINARY[op](ins[0], ins[1]).astype(np.float32)
        if op in _UNARY:
            return _UNARY[op](ins[0]).astype(np.float32)
        if op in ("Max", "Min"):
            fn = np.maximum if op == "Max" else np.minimum
            out = ins[0]
            for other in ins[1:]:
                out = fn(out, other)
            return out
        if op == "Clip":
            return _clip(node, ins)
        if op in _REDUCES:
            return _reduce(node, ins, ints)
        if op in _MOVES and shape is not None:
            return ins[0].reshape(shape)
        if op == "Transpose":
            perm = attr(node, "perm") or list(range(ins[0].ndim))[::-1]
            return np.transpose(ins[0], perm)
    return None


class Replay:
    """FP16-stored values of one batch, by tensor name, within ``depth`` nodes of where
    they are asked for. ``producer``: tensor -> node; ``consts``: float constants;
    ``ints``: integer constants (axes); ``values``: the batch's FP32 tensors by name."""

    def __init__(self, producer: dict, consts: dict, ints: dict, values: dict, depth: int = 8):
        self.producer, self.consts, self.ints, self.values = producer, consts, ints, values
        self.depth = depth
        self._memo: dict[str, tuple[int, np.ndarray | None]] = {}

    def fp32(self, t: str) -> np.ndarray | None:
        v = self.consts.get(t)
        if v is None:
            v = self.values.get(t)
        if v is None or np.asarray(v).dtype.kind != "f":
            return None
        return np.asarray(v, dtype=np.float32)

    def __call__(self, t: str, depth: int | None = None) -> np.ndarray | None:
        depth = self.depth if depth is None else depth
        if t in self.ints:  # an integer constant (a Pow exponent): exact in float32
            return np.asarray(self.ints[t], dtype=np.float32)
        got = self._memo.get(t)
        if got is not None and got[0] >= depth:
            return got[1]
        out = self._compute(t, depth)
        self._memo[t] = (depth, out)
        return out

    def _compute(self, t: str, depth: int) -> np.ndarray | None:
        ref = self.fp32(t)
        node = self.producer.get(t)
        if t in self.consts or node is None or depth <= 0 or node.op_type not in EVALUATED:
            return None if ref is None else to_fp16(ref)
        ins = []
        for k, i in enumerate(node.input):
            if k >= FLOAT_INPUTS.get(node.op_type, len(node.input)):
                break
            ins.append(self(i, depth - 1) if i else None)
        if not ins or ins[0] is None:
            return None if ref is None else to_fp16(ref)
        shape = None if ref is None else ref.shape
        out = evaluate(node, ins, self.ints, shape)
        if out is None or (ref is not None and out.shape != ref.shape):
            return None if ref is None else to_fp16(ref)
        return to_fp16(out)
