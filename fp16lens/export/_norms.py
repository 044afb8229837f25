"""Find normalizations the export decomposed: a sum of squares stored in FP16.

LayerNorm below opset 17, GroupNorm below 18 (or a hand-written norm) becomes
ReduceMean(Pow(x - mean, 2)): the square overflows FP16 once |x - mean| > 255.9, although
the norm's output is in range. A fused LayerNormalization / GroupNormalization /
InstanceNormalization node keeps the variance internal.
"""

from __future__ import annotations

from onnx import numpy_helper

from fp16lens.export._naming import NodeOrigin

_REDUCE = {"ReduceMean", "ReduceSum", "ReduceSumSquare"}


def _is_square(node, constants: dict[str, float]) -> bool:
    if node.op_type == "Mul" and len(node.input) == 2:
        return node.input[0] == node.input[1]
    return node.op_type == "Pow" and constants.get(node.input[1]) == 2.0


def _scalar_constants(graph) -> dict[str, float]:
    out = {}
    for init in graph.initializer:
        if init.data_type in (1, 10, 11) and numpy_helper.to_array(init).size == 1:
            out[init.name] = float(numpy_helper.to_array(init).ravel()[0])
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            array = numpy_helper.to_array(node.attribute[0].t)
            if array.size == 1:
                out[node.output[0]] = float(array.ravel()[0])
    return out


def decomposed_norm_warnings(graph, origins: list[NodeOrigin]) -> list[str]:
    """One warning per module whose exported graph squares values then reduces them."""
    constants = _scalar_constants(graph)
    consumers: dict[str, list] = {}
    for node in graph.node:
        for t in node.input:
            consumers.setdefault(t, []).append(node)
    modules: list[str] = []
    for node, origin in zip(graph.node, origins):
        squares = _is_square(node, constants) or node.op_type == "ReduceSumSquare"
        feeds_reduce = node.op_type == "ReduceSumSquare" or any(
            c.op_type in _REDUCE for c in consumers.get(node.output[0], [])
        )
        if squares and feeds_reduce and origin.module is not None:
            modules.append(origin.module or "<root>")
    return [
        f"{m!r} is exported as a decomposed normalization (square, then reduce): the square "
        "overflows FP16 once |x| (|x - mean| for a variance) > 255.9, though the norm's output "
        "is in range. Keep it one node (LayerNorm: opset >= 17, GroupNorm: >= 18, RMSNorm: "
        f">= 23) or keep it in FP32: fp32_modules=[{m!r}]"
        for m in dict.fromkeys(modules)
    ]
