"""Conv/Gemm/MatMul FLOPs of an ONNX graph from its inferred shapes, and the share of them
that runs in FP16 (a node whose float inputs are all FP16).

FLOPs are 2 x multiply-accumulates: a Conv computes prod(Y) x (C_in / group) x prod(kernel)
of them (the weight's dims after the first), a Gemm M x N x K, a MatMul prod(Y) x K.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from math import prod

import onnx

F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
HEAVY = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class NodeFlops:
    name: str
    op_type: str
    flops: int
    fp16: bool


def _tensor_info(proto, input_shapes=None) -> tuple[dict[str, list[int | None]], dict[str, int]]:
    """Shape and element type of every tensor shape inference can tell; ``input_shapes``
    (one shape per graph input) fixes a graph's dynamic input dims first."""
    if input_shapes is not None:
        proto = _static(proto, input_shapes)
    g = onnx.shape_inference.infer_shapes(proto).graph
    shapes = {t.name: list(t.dims) for t in g.initializer}
    types = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        tt = vi.type.tensor_type
        types[vi.name] = tt.elem_type
        if tt.HasField("shape"):
            shapes[vi.name] = [
                d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim
            ]
    for node in g.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].HasField("t"):
            shapes[node.output[0]] = list(node.attribute[0].t.dims)
            types[node.output[0]] = node.attribute[0].t.data_type
    return shapes, types


def _static(proto, input_shapes):
    proto = copy.deepcopy(proto)
    del proto.graph.value_info[:]  # stale dynamic shapes a converter copied would stay unknown
    inits = {t.name for t in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in inits]
    for vi, shape in zip(inputs, input_shapes):
        dims = vi.type.tensor_type.shape.dim
        del dims[:]
        for n in shape:
            dims.add().dim_value = int(n)
    return proto


def _macs(node, shapes: dict) -> int | None:
    """Multiply-accumulates of one heavy node, None when a shape is unknown."""
    out = shapes.get(node.output[0])
    if not out or None in out:
        return None
    if node.op_type == "Conv":
        w = shapes.get(node.input[1])
        return None if not w or None in w else prod(out) * prod(w[1:])
    a = shapes.get(node.input[0])
    if not a or a[-1] is None:
        return None
    trans_a = any(x.name == "transA" and x.i for x in node.attribute)
    k = a[0] if node.op_type == "Gemm" and trans_a else a[-1]
    return prod(out) * k


def heavy_nodes(proto, input_shapes=None) -> list[NodeFlops]:
    """Every Conv/Gemm/MatMul with its FLOPs; raises when a shape cannot be inferred."""
    shapes, types = _tensor_info(proto, input_shapes)
    rows = []
    for node in proto.graph.node:
        if node.op_type not in HEAVY:
            continue
        macs = _macs(node, shapes)
        if macs is None:
            raise ValueError(f"shape inference left {node.op_type} {node.name!r} without shapes")
        floats = [types.get(i) for i in node.input[:2] if i]
        rows.append(NodeFlops(node.name, node.op_type, 2 * macs, all(t == F16 for t in floats)))
    return rows


def fp16_share(proto, input_shapes=None, reference=None) -> float:
    """Share (0..1) of the graph's Conv/Gemm/MatMul FLOPs whose inputs are FP16.
    ``reference``: the FP32 graph ``proto`` was converted from; a heavy node's FLOPs come
    from its namesake there (a converter's Casts before a Resize's scales leave shape
    inference without the shapes after it)."""
    rows = (
        heavy_nodes(proto, input_shapes)
        if reference is None
        else _by_reference(proto, reference, input_shapes)
    )
    total = sum(r.flops for r in rows)
    return sum(r.flops for r in rows if r.fp16) / total if total else 0.0


def _by_reference(proto, reference, input_shapes) -> list[NodeFlops]:
    flops = {r.name: r.flops for r in heavy_nodes(reference, input_shapes)}
    _, types = _tensor_info(proto)
    rows = []
    for node in proto.graph.node:
        if node.op_type in HEAVY:
            if node.name not in flops:
                raise ValueError(
                    f"{node.op_type} {node.name!r} is not in the FP32 graph it came from"
                )
            floats = [types.get(i) for i in node.input[:2] if i]
            rows.append(
                NodeFlops(node.name, node.op_type, flops[node.name], all(t == F16 for t in floats))
            )
    return rows


def fp32_nodes(proto) -> int:
    """Nodes (not Cast/Constant) with an output typed FP32: what stays in FP32."""
    _, types = _tensor_info(proto)
    skip = ("Cast", "Constant", "CastLike")
    return sum(
        1
        for n in proto.graph.node
        if n.op_type not in skip and any(types.get(o) == F32 for o in n.output if o)
    )
