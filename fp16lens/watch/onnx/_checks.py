"""Overflow inside ONNX nodes that never shows at their outputs (the ONNX counterpart of
``watch._internal``): a norm node's (x-mean)^2, a mean or average pool's sum before
the divide. A node is checked only when its inputs are in range: otherwise the span
through it already says so. A decomposed norm (ReduceMean, Sub, Pow, ReduceMean) needs no
check: its Pow output is stored, an ordinary site (``decomposed_norm`` names it).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fp16lens._core.sites import FindingKind
from fp16lens.watch._internal import _dev_sq

_NORMS = ("LayerNormalization", "GroupNormalization", "InstanceNormalization")
_MEANS = ("ReduceMean", "GlobalAveragePool", "AveragePool")


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return list(a.ints) if a.ints else a.i if a.type == a.INT else a.f
    return default


def _norm(node, x: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if node.op_type == "LayerNormalization":
        axis = _attr(node, "axis", -1) % t.dim()
        return _dev_sq(t, tuple(range(axis, t.dim())))
    if node.op_type == "GroupNormalization":
        return _dev_sq(t.reshape(t.shape[0], _attr(node, "num_groups"), -1), (-1,))
    return _dev_sq(t, tuple(range(2, t.dim())))


def _count(node, x: np.ndarray, values: dict) -> int:
    """How many values one output element sums."""
    if node.op_type == "GlobalAveragePool":
        return math.prod(x.shape[2:])
    if node.op_type == "AveragePool":
        return math.prod(_attr(node, "kernel_shape"))
    axes = _attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        axes = [int(a) for a in np.asarray(values.get(node.input[1], [])).reshape(-1)]
    if not axes:
        return 1 if _attr(node, "noop_with_empty_axes", 0) else x.size
    return math.prod(x.shape[a % x.ndim] for a in axes)


def internal_checks(graph, values: dict, maxes: dict[str, float], threshold: float) -> list:
    """``Forward.internal`` entries: (site id, kind, peak as a 0-d tensor, context)."""
    out = []
    for sid, node in enumerate(graph.nodes):
        if node.op_type not in _NORMS and node.op_type not in _MEANS:
            continue
        x = values.get(node.input[0]) if node.input else None
        if x is None or not maxes.get(node.input[0], 0.0) <= threshold:
            continue
        if node.op_type in _NORMS:
            out.append(
                (
                    sid,
                    FindingKind.NORM_VARIANCE,
                    _norm(node, x),
                    {"norm": node.op_type, "opset": None},
                )
            )
            continue
        n = _count(node, x, {**graph.consts, **values})
        peak = maxes.get(node.output[0], 0.0) * n
        if n > 1 and peak > threshold:
            out.append(
                (sid, FindingKind.SUM_BEFORE_MEAN, torch.tensor(peak), {"op": node.op_type, "n": n})
            )
    return out


def decomposed_norm(graph, sid: int) -> bool:
    """Whether site ``sid`` is the Pow(x - ReduceMean(x), 2) of a decomposed norm."""
    node = graph.nodes[sid]
    if node.op_type != "Pow" or len(node.input) < 2:
        return False
    exponent = graph.consts.get(node.input[1])
    if exponent is None or exponent.size != 1 or float(exponent.reshape(-1)[0]) != 2.0:
        return False
    sub = _producer(graph, node.input[0])
    if sub is None or sub.op_type != "Sub" or len(sub.input) < 2:
        return False
    mean = _producer(graph, sub.input[1])
    return mean is not None and mean.op_type == "ReduceMean"


def _producer(graph, tensor: str):
    for node in graph.nodes:
        if tensor in node.output:
            return node
    return None
