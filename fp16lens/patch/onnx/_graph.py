"""An ONNX graph as patch reads it: the report's sites mapped back onto nodes (named as
``fp16lens.scan`` names them: the node's name, else its first output, ``#k`` when
repeated), the float constants (initializers and Constant nodes) and who reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fp16lens._core import PatchError, import_optional
from fp16lens._core.onnx_types import elem_types, in_order, read_file
from fp16lens._core.onnx_upcast import fp32_twin

if TYPE_CHECKING:  # onnx is optional (and not followed by mypy: its names are Any)
    from onnx import ModelProto, NodeProto

FLOAT_TYPES = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


def onnx_module():
    return import_optional("onnx", "onnx", "patching an ONNX model")


@dataclass
class OnnxModel:
    proto: ModelProto
    nodes: dict[str, NodeProto] = field(default_factory=dict)  # site -> node
    consts: dict[str, np.ndarray] = field(default_factory=dict)  # float constants by tensor
    inits: set[str] = field(default_factory=set)  # initializer names
    readers: dict[str, list[tuple[NodeProto, int]]] = field(
        default_factory=dict
    )  # tensor -> (node, slot)
    producer: dict[str, NodeProto] = field(default_factory=dict)  # tensor -> node
    elem: dict[str, int] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)  # graph inputs that are not initializers
    const_sites: set[str] = field(default_factory=set)  # Identity of a constant (shared weights)

    def const(self, node, slot: int) -> np.ndarray | None:
        """The float constant read at input ``slot`` of ``node`` (None: absent or computed)."""
        return self.consts.get(node.input[slot]) if slot < len(node.input) else None

    def sole_reader(self, tensor: str, op_type: str | None = None):
        """The one node reading ``tensor`` (of ``op_type``), or None."""
        readers = {id(n): n for n, _ in self.readers.get(tensor, [])}
        if len(readers) != 1 or tensor in self.outputs:
            return None
        node = next(iter(readers.values()))
        return node if op_type is None or node.op_type == op_type else None

    @property
    def outputs(self) -> set[str]:
        return {o.name for o in self.proto.graph.output}


def load(model, copy: bool = True):
    """A ModelProto (a copy of a proto, external data read in) from a path or a proto; a
    file that already computes in float16 as its FP32 twin, as the scan read it
    (``_core/onnx_upcast.py``): the patched graph is FP32. ``copy`` False: a proto given is
    not copied, for a caller that only reads it (a large graph's weights are not held
    twice)."""
    onnx = onnx_module()
    if isinstance(model, (str, Path)):
        proto = read_file(onnx, Path(model), PatchError)
    else:
        if any(t.data_location == 1 for t in model.graph.initializer):
            raise PatchError(
                "the ONNX model keeps tensors in external data files that were not loaded; "
                "pass its path instead (fp16lens.patch('model.onnx', report)) so they are read in"
            )
        proto = model
        if copy:
            proto = onnx.ModelProto()
            proto.CopyFrom(model)
    return fp32_twin(in_order(proto), onnx)[0]


def read(proto, values: bool = True) -> OnnxModel:
    """The graph's maps (nodes by site, readers, producers, element types); ``values``
    False: without the float constants' values (``consts`` empty), which cost the weights'
    size again, for a caller that only needs the structure."""
    numpy_helper = onnx_module().numpy_helper
    g = proto.graph
    m = OnnxModel(
        proto, elem=elem_types(proto, onnx_module()), inits={i.name for i in g.initializer}
    )
    m.inputs = [i.name for i in g.input if i.name not in m.inits]
    for init in g.initializer if values else ():
        if init.data_type in FLOAT_TYPES:
            m.consts[init.name] = numpy_helper.to_array(init)
    taken: dict[str, int] = {}
    for node in g.node:
        for slot, t in enumerate(node.input):
            m.readers.setdefault(t, []).append((node, slot))
        for o in node.output:
            m.producer[o] = node
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if values and value is not None and value.data_type in FLOAT_TYPES:
                m.consts[node.output[0]] = numpy_helper.to_array(value)
            continue
        if not any(o and m.elem.get(o) in FLOAT_TYPES for o in node.output):
            continue
        base = node.name or node.output[0]
        taken[base] = taken.get(base, 0) + 1
        site = base if taken[base] == 1 else f"{base}#{taken[base]}"
        m.nodes[site] = node
        if node.op_type == "Identity" and node.input[0] in m.consts:  # a deduplicated initializer
            m.consts[node.output[0]] = m.consts[node.input[0]]
            m.const_sites.add(site)
    return m


def attr(node, name: str, default=None):
    """A node attribute's value (int, float, string, ints or floats), or ``default``."""
    helper = onnx_module().helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default
