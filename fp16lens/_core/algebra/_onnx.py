"""ONNX operators by op_type, for the ONNX-in path (the report's advice; patch's
``OnnxBinding`` refines it into kinds by the nodes' constant operands).

In ONNX a Conv/Gemm/MatMul weight and a BatchNormalization's statistics are initializers,
so those ops absorb a scale. Resize is homogeneous in its nearest and (bi/tri)linear
modes, Pad in constant mode with value 0; Add, Sub and Concat are joins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp16lens._core.algebra._classes import OpClass

_ABSORBING = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization"})
_INVARIANT = frozenset({"LayerNormalization", "GroupNormalization", "InstanceNormalization"})
ONNX_JOINS = frozenset({"Add", "Sub", "Concat"})
_HOMOGENEOUS = ONNX_JOINS | {
    "Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalAveragePool",
    "GlobalMaxPool", "Reshape", "Transpose", "Slice", "Flatten", "Squeeze", "Unsqueeze",
    "Identity", "Dropout",
}  # fmt: skip
_RESIZE_MODES = frozenset({"nearest", "linear"})


def onnx_class(op_type: str, attrs: Mapping[str, Any] | None = None) -> OpClass:
    """The class of an ONNX node. ``attrs``: Resize's ``mode`` (default nearest); Pad's
    ``mode`` (default constant) and ``value``, its constant (default 0)."""
    attrs = attrs or {}
    if op_type in _ABSORBING:
        return OpClass.ABSORBING
    if op_type in _INVARIANT:
        return OpClass.INVARIANT
    if op_type in _HOMOGENEOUS:
        return OpClass.HOMOGENEOUS
    if op_type == "Resize" and _text(attrs.get("mode", "nearest")) in _RESIZE_MODES:
        return OpClass.HOMOGENEOUS
    if op_type == "Pad" and _text(attrs.get("mode", "constant")) == "constant":
        return OpClass.HOMOGENEOUS if float(attrs.get("value", 0.0)) == 0 else OpClass.BLOCKING
    return OpClass.BLOCKING


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
