"""An ONNX file that already computes in float16, read as its FP32 twin.

fp16lens measures a graph's FP32 values against FP16's limits. In a graph converted to
FP16 (onnxconverter-common, an exporter run on a ``.half()`` model) ONNX Runtime stores
every value in FP16: what overflowed is already inf, and a scan of the file as it is sees
values "within range" and calls a graph whose output is NaN FP16-safe. The scan and the
ONNX patch therefore read such a file as its twin with every float16 tensor, attribute and
declared type made float32 (``upcast``): the same nodes under the same names, the values
FP32 reaches. The verdict check then runs that twin in FP16 storage, which is what the
file computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fp16lens._core.onnx_types import FP32_NODES_KEY, PRECISION_KEY, elem_types

FLOAT, FLOAT16 = 1, 10
_DTYPE_ATTRS = {"to", "dtype"}  # Cast's target; RandomNormal*, RandomUniform*, EyeLike, Multinomial


def _graphs(graph):
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.type == a.GRAPH:
                yield from _graphs(a.g)
            elif a.type == a.GRAPHS:
                for g in a.graphs:
                    yield from _graphs(g)


def _any_fp16(graph) -> bool:
    """Whether any tensor, declared type or Cast of the graph (or a body) is float16."""
    for g in _graphs(graph):
        if any(t.data_type == FLOAT16 for t in g.initializer):
            return True
        if any(
            vi.type.tensor_type.elem_type == FLOAT16 for vi in (*g.input, *g.output, *g.value_info)
        ):
            return True
        for node in g.node:
            for a in node.attribute:
                if (a.HasField("t") and a.t.data_type == FLOAT16) or (
                    a.name in _DTYPE_ATTRS and a.type == a.INT and a.i == FLOAT16
                ):
                    return True
    return False


_MOVES = frozenset(
    [
        "Cast",
        "CastLike",
        "Constant",
        "Identity",
        "Reshape",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Gather",
        "GatherElements",
        "GatherND",
        "Slice",
        "Split",
        "Concat",
        "Expand",
        "Tile",
        "Pad",
        "Shape",
        "Size",
        "DepthToSpace",
        "SpaceToDepth",
    ]
)
"""Ops that compute no value of their own (they cast, move or pick values): an FP16 export's
island is mostly such reshapes around a few MatMuls, so they do not count towards the share."""


_CASTS = frozenset(["Cast", "CastLike", "Constant"])


def _computing(proto, elem: dict[str, int], skip: frozenset = _MOVES):
    """(node name, its float outputs' types) of the main graph's nodes that write floats,
    the op types of ``skip`` aside (casts and moves)."""
    for node in proto.graph.node:
        if node.op_type in skip:
            continue
        floats = [elem.get(o) for o in node.output if o and elem.get(o) in (FLOAT, FLOAT16)]
        if floats:
            yield node.name or node.output[0], floats


def fp16_share(proto, elem: dict[str, int]) -> float:
    """The share of the main graph's computing nodes (``_computing``) that write float16;
    ``elem``: the tensor types of ``onnx_types.elem_types``."""
    kinds = [FLOAT16 in floats for _, floats in _computing(proto, elem)]
    return sum(kinds) / len(kinds) if kinds else 0.0


TWIN_KEY = "fp16lens.fp32_twin"
"""The ``metadata_props`` key of an FP32 twin (its value: the FP16 file's float16 share), which
a patched twin keeps: the patch says its graph is FP32."""

FP16_FILE = 0.5
"""A graph where at least this share of the computing nodes write float16 computes in FP16 (a
graph converted to FP16, its FP32 islands aside; a file fp16lens.export wrote in fp16 is one
whatever its share): the scan and the patch read its FP32 twin,
those islands kept FP32. Below it the graph is an FP32 one (a few FP16 tensors, such as an
embedding table stored in FP16, aside) that TensorRT's FP16 mode would turn FP16 as a whole."""


def fp32_in_file(proto, elem: dict[str, int]) -> list[str]:
    """The main graph's nodes that the file runs in FP32 (every float output FLOAT; moves
    too, Casts and Constants aside): a converter's blocked ops, an FP16 export's islands."""
    found = _computing(proto, elem, skip=_CASTS)
    return [name for name, floats in found if all(e == FLOAT for e in floats)]


def upcast(proto, onnx: Any, fp32_nodes: Sequence[str] = (), elem: dict[str, int] | None = None):
    """A copy of ``proto`` with every float16 tensor (initializers, Constant values),
    dtype attribute (Cast ``to``, a random op's ``dtype``) and declared type (inputs,
    outputs, value_info) made float32, in every body; ``onnx``: the imported module. The
    nodes of ``fp32_nodes`` (``fp32_in_file``) join the FP32 islands its metadata names
    (``FP32_NODES_KEY``), so the twin's FP16 storage keeps them FP32 as the file does.
    A main-graph Cast between the two float types (``elem``: the file's element types)
    becomes an Identity of the same name: in the twin it changes nothing, and
    onnxconverter-common, converting the patched twin back to FP16, leaves a Cast to
    float32 as it is and writes a graph that mixes types (an input Cast of
    ``keep_io_types``)."""
    import json

    from onnx import numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    if fp32_nodes:
        meta = {p.key: p for p in model.metadata_props}
        kept = json.loads(meta[FP32_NODES_KEY].value) if FP32_NODES_KEY in meta else []
        names = list(dict.fromkeys([*kept, *fp32_nodes]))
        if FP32_NODES_KEY in meta:
            meta[FP32_NODES_KEY].value = json.dumps(names)
        else:
            model.metadata_props.add(key=FP32_NODES_KEY, value=json.dumps(names))
    floats = (FLOAT, FLOAT16)
    for node in model.graph.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if node.op_type == "Cast" and to in floats and (elem or {}).get(node.input[0]) in floats:
            node.op_type = "Identity"
            del node.attribute[:]
    for g in _graphs(model.graph):
        for vi in (*g.input, *g.output, *g.value_info):
            tt = vi.type.tensor_type
            if vi.type.HasField("tensor_type") and tt.elem_type == FLOAT16:
                tt.elem_type = FLOAT
        for t in list(g.initializer):
            if t.data_type == FLOAT16:
                t.CopyFrom(_as_float(t, numpy_helper))
        for node in g.node:
            for a in node.attribute:
                if a.HasField("t") and a.t.data_type == FLOAT16:
                    a.t.CopyFrom(_as_float(a.t, numpy_helper))
                elif a.name in _DTYPE_ATTRS and a.type == a.INT and a.i == FLOAT16:
                    a.i = FLOAT
    return model


def _as_float(t, numpy_helper):
    import numpy as np

    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def fp32_twin(proto, onnx: Any) -> tuple[Any, float]:
    """(``proto`` itself, 0) or, where it already computes in float16 (``FP16_FILE``), (its
    FP32 twin with the nodes the file keeps in FP32 named as islands, the FP16 share): what
    the scan and the ONNX patch read."""
    if not _any_fp16(proto.graph):  # an FP32 graph: no shape inference needed
        return proto, 0.0
    elem = elem_types(proto, onnx)
    share = fp16_share(proto, elem)
    written = {p.key: p.value for p in proto.metadata_props}.get(PRECISION_KEY)
    if share < FP16_FILE and not (written == "fp16" and share > 0):  # fp16lens's own FP16
        return proto, 0.0
    twin = upcast(proto, onnx, fp32_in_file(proto, elem), elem)
    twin.metadata_props.add(key=TWIN_KEY, value=f"{share:.3f}")
    return twin, share
