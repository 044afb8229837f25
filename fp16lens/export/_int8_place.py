"""Where INT8 goes: Q/DQ placed as TensorRT runs it.

TensorRT computes in INT8 where a Conv, ConvTranspose, Gemm or MatMul reads a dequantized
input and dequantized weights; it fuses the bias, the activation after it and a residual
Add into that kernel. So Q/DQ go only at those inputs (activations per tensor, weights per
output channel), and at the *residual* input of an Add that sums a conv's output with a
skip connection (TensorRT's Q/DQ placement rule for residual fusion: the skip input is
quantized, the conv branch is not; ModelOpt's ``build_non_residual_input_map`` picks the
same input). No op's output is quantized for its own sake: a hardswish internal, a
sigmoid or a resize stays float, as TensorRT leaves it between fused kernels.

A ``Unit`` is one thing that can be left out of INT8: a conv-like node (its activation
inputs and its weight), or a residual Add's skip input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
# ops a conv's output passes through and that TensorRT still fuses into that conv
_FUSIBLE = frozenset(
    {
        "BatchNormalization",
        "Relu",
        "Clip",
        "LeakyRelu",
        "Sigmoid",
        "HardSigmoid",
        "HardSwish",
        "Mul",
        "Add",
    }
)


@dataclass(frozen=True)
class Unit:
    """One node's INT8: ``acts`` are quantized per tensor, ``weight`` (an initializer) per
    channel along ``axis``; ``flops`` its multiply-adds over all the calibration batches."""

    node: str
    op: str
    acts: tuple[str, ...]
    weight: str | None = None
    axis: int | None = None
    flops: int = 0

    @property
    def residual(self) -> bool:
        return self.op == "Add"


def name_nodes(graph) -> None:
    """Give every unnamed node a unique name (Q/DQ placement and reports refer to nodes by name)."""
    seen = {n.name for n in graph.node if n.name}
    for i, node in enumerate(graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in seen:
                name += "_"
            node.name = name
            seen.add(name)


def _weight_axis(node, shape: tuple[int, ...]) -> int | None:
    """The output-channel axis of a weight, or None where TensorRT takes it per tensor."""
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        group = attrs["group"].i if "group" in attrs else 1
        return 1 if group == 1 else None
    if node.op_type == "Gemm":
        trans_b = attrs["transB"].i if "transB" in attrs else 0
        return 0 if trans_b else 1
    if node.op_type == "MatMul":
        return len(shape) - 1 if len(shape) == 2 else None
    return None


def find_units(graph, exclude: set[str], residual: bool = True) -> list[Unit]:
    """The units of ``graph`` (nodes in ``exclude`` stay float), in graph order."""
    inits = {i.name: tuple(i.dims) for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    units = []
    for node in graph.node:
        if node.name in exclude:
            continue
        if node.op_type in COMPUTE_OPS:
            ins = [t for t in node.input[:2] if t]
            if len(ins) < 2:
                continue
            w = ins[1] if ins[1] in inits else None
            if ins[0] in inits:  # a constant first operand (MatMul(W, x)): not handled
                continue
            acts = tuple(t for t in ins if t not in inits)
            axis = _weight_axis(node, inits[w]) if w else None
            units.append(Unit(node.name, node.op_type, acts, w, axis))
        elif residual and node.op_type == "Add":
            skip = residual_input(node, producer, inits, graph)
            if skip is not None:
                units.append(Unit(node.name, "Add", (skip,)))
    return units


def _conv_backbone(tensor: str, producer: dict, readers: dict, depth: int = 4):
    """The conv whose output reaches ``tensor`` through single-reader fusible ops, or None."""
    node = producer.get(tensor)
    for _ in range(depth):
        if node is None:
            return None
        if node.op_type in ("Conv", "ConvTranspose"):
            return node
        if node.op_type not in _FUSIBLE or len(readers.get(node.output[0], ())) != 1:
            return None
        node = producer.get(node.input[0])
    return None


def residual_input(node, producer: dict, inits, graph) -> str | None:
    """The skip input of a residual Add (conv branch + skip), the one TensorRT wants
    quantized to fuse the Add into the conv; None for any other Add."""
    if len(node.input) != 2 or any(t in inits or t not in producer for t in node.input):
        return None
    readers: dict[str, list] = {}
    for n in graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    convs = [_conv_backbone(t, producer, readers) for t in node.input]
    if convs[0] is None and convs[1] is None:
        return None
    if convs[0] is not None and convs[1] is not None:
        order = {n.name: i for i, n in enumerate(graph.node)}
        later = 0 if order[convs[0].name] > order[convs[1].name] else 1  # the branch just computed
        return node.input[1 - later]
    return node.input[1 if convs[0] is not None else 0]


def node_flops(node, shapes: dict[str, tuple[int, ...]], inits: dict[str, tuple[int, ...]]) -> int:
    """Multiply-adds of a conv-like node from its input/output shapes (0 when unknown)."""
    out = shapes.get(node.output[0])
    w = inits.get(node.input[1]) or shapes.get(node.input[1])
    x = shapes.get(node.input[0])
    if out is None or w is None:
        return 0
    if node.op_type == "Conv":
        return int(np.prod(out)) * int(np.prod(w[1:]))
    if node.op_type == "ConvTranspose":
        return int(np.prod(x)) * int(np.prod(w[1:])) if x is not None else 0
    if node.op_type in ("MatMul", "Gemm"):
        attrs = {a.name: a.i for a in node.attribute}
        k = (
            w[1]
            if node.op_type == "Gemm" and attrs.get("transB", 0)
            else w[-2]
            if len(w) >= 2
            else w[0]
        )
        return int(np.prod(out)) * int(k)
    return 0


def int8_flop_share(proto, shapes: dict[str, tuple[int, ...]]) -> tuple[float, int]:
    """(share of Conv/ConvTranspose/Gemm/MatMul multiply-adds whose data and weight inputs
    are dequantized, total multiply-adds) of a Q/DQ graph, given the tensors' shapes."""
    g = proto.graph
    inits = {i.name: tuple(i.dims) for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    total = int8 = 0
    for node in g.node:
        if node.op_type not in COMPUTE_OPS or len(node.input) < 2:
            continue
        w_in = node.input[1]
        dq = producer.get(w_in)
        w_shape = (
            inits.get(w_in)
            or (
                inits.get(dq.input[0])
                if dq is not None and dq.op_type == "DequantizeLinear"
                else None
            )
            or shapes.get(w_in)
        )
        f = node_flops(node, shapes, {w_in: w_shape} if w_shape else {})
        total += f
        if all(
            producer.get(t) is not None and producer[t].op_type == "DequantizeLinear"
            for t in node.input[:2]
        ):
            int8 += f
    return (int8 / total if total else 0.0), total
