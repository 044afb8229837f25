"""Which float inputs/outputs of an ONNX node follow its compute precision (from the op schema).

An input declared with a type variable (``T``) follows the node's precision; one declared
with a concrete type (Resize's ``scales: tensor(float)``) keeps FP32 whatever the node runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx import TensorProto, defs

from fp16lens._core.onnx_types import has_subgraph

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16


@dataclass(frozen=True)
class NodeTyping:
    """Required dtype per input and produced dtype per output (None: not a float tensor)."""

    fp32: bool
    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]
    forced: str = ""  # why a node outside any island must run in FP32


def schema_of(node, opset: int):
    try:
        return defs.get_schema(node.op_type, opset, node.domain or "")
    except defs.SchemaError:
        return None


def _formal(params, i: int):
    if i < len(params):
        return params[i]
    last = params[-1] if params else None
    if last is not None and last.option == defs.OpSchema.FormalParameterOption.Variadic:
        return last
    return None


def _is_float(elem: dict[str, int], name: str) -> bool:
    return bool(name) and elem.get(name) == FLOAT


def type_node(node, opset: int, elem: dict[str, int], in_island: bool) -> NodeTyping:
    """Plan the precision of one node of an FP32 graph."""
    floats_in = [_is_float(elem, t) for t in node.input]
    floats_out = [_is_float(elem, t) for t in node.output]
    if not any(floats_in) and not any(floats_out):
        return NodeTyping(in_island, (None,) * len(node.input), (None,) * len(node.output))
    schema = schema_of(node, opset)
    forced = "" if schema else f"no ONNX schema for {node.domain or 'ai.onnx'}::{node.op_type}"
    if schema and not in_island:
        forced = _fp16_unsupported(schema, node, floats_in, floats_out)
    if not in_island and has_subgraph(node):
        forced = f"its {node.op_type} body runs as written, in FP32 (subgraphs are not converted)"
    fp32 = in_island or bool(forced)
    want = FLOAT if fp32 else FLOAT16
    ins = tuple(
        _required(schema, schema.inputs if schema else [], i, f, want)
        for i, f in enumerate(floats_in)
    )
    outs = tuple(
        _required(schema, schema.outputs if schema else [], i, f, want)
        for i, f in enumerate(floats_out)
    )
    return NodeTyping(fp32, ins, outs, forced)


def _required(schema, params, i: int, is_float: bool, want: int) -> int | None:
    if not is_float:
        return None
    formal = _formal(params, i) if schema else None
    if formal is None or formal.type_str.startswith(("tensor(", "seq(")):
        return FLOAT
    return want


def _fp16_unsupported(schema, node, floats_in, floats_out) -> str:
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    used = [
        _formal(params, i)
        for params, flags in ((schema.inputs, floats_in), (schema.outputs, floats_out))
        for i, f in enumerate(flags)
        if f
    ]
    for formal in used:
        if formal is not None and "tensor(float16)" not in allowed.get(
            formal.type_str, ["tensor(float16)"]
        ):
            return f"ONNX {node.op_type} has no float16 form"
    return ""
