"""An ONNX graph as watch sees it: one site per node with a float output, the float
constants (initializers and Constant nodes) as its parameters, and a copy of the graph
that returns every float intermediate as an output.

A site is named by its node's name, or by its first output when the exporter left the
name empty (PaddlePaddle's paddle2onnx does: ``batch_norm_0.tmp_3``); its ``op`` is the
op type and its ``module`` the site itself (an ONNX node is its own unit).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fp16lens._core import WatchError, import_optional, onnx_large
from fp16lens._core.feeds import ONNX_FLOATS
from fp16lens._core.onnx_types import FP32_NODES_KEY, elem_types, in_order, read_file
from fp16lens._core.onnx_upcast import fp32_twin
from fp16lens.watch._recorder import SiteInfo

if TYPE_CHECKING:  # onnx is optional (and not followed by mypy: its names are Any)
    from onnx import ModelProto

FLOATS = ONNX_FLOATS
_PURPOSE = "scanning an ONNX model"


def onnx_module():
    return import_optional("onnx", "onnx", _PURPOSE)


@dataclass
class OnnxGraph:
    proto: ModelProto  # the model as loaded (external data inline)
    name: str
    sites: list[SiteInfo] = field(default_factory=list)
    nodes: list = field(default_factory=list)  # the node of each site
    events: list[tuple[int, str]] = field(default_factory=list)  # (site, tensor) in graph order
    inputs: list[str] = field(default_factory=list)  # graph inputs (not initializers)
    elem: dict[str, int] = field(default_factory=dict)
    consts: dict[str, np.ndarray] = field(default_factory=dict)  # float constants by name
    consumers: dict[str, list[int]] = field(default_factory=dict)  # tensor -> site ids
    outputs: list[str] = field(default_factory=list)
    # an inlined graph (watch/onnx/_inline.py): the If conditions it assumes, (tensor, value)
    checks: list[tuple[str, bool]] = field(default_factory=list)
    # a file that already computes in float16, scanned as its FP32 twin: its float16 share
    fp16_source: float = 0.0
    # sites an FP16 graph keeps in FP32 (metadata ``FP32_NODES_KEY``): values not judged
    fp32: set[str] = field(default_factory=set)

    @contextlib.contextmanager
    def exposing(self):
        """The graph returning every event tensor (graph outputs first, as the graph has
        them) and the computed conditions of ``checks``, while inside: outputs added to
        ``proto`` itself (a copy would cost the weights' size again) and taken off after."""
        onnx = onnx_module()
        outputs = self.proto.graph.output
        kept = len(outputs)
        present = {o.name for o in outputs}
        try:
            for _, t in self.events:
                if t not in present:
                    outputs.append(onnx.helper.make_tensor_value_info(t, self.elem[t], None))
                    present.add(t)
            for t, _ in self.checks:
                if t not in present and t not in self.inputs:
                    outputs.append(
                        onnx.helper.make_tensor_value_info(t, onnx.TensorProto.BOOL, None)
                    )
                    present.add(t)
            yield self.proto
        finally:
            del outputs[kept:]


def load(model, base_dir: str | Path | None = None):
    """A ModelProto from a path or a proto, with its external data read in."""
    onnx = onnx_module()
    if isinstance(model, (str, Path)):
        path = Path(model)
        return read_file(onnx, path, WatchError), path.stem
    external = [t.name for t in onnx_large.tensors(model.graph) if t.data_location == 1]
    if external:
        if base_dir is None:
            raise WatchError(
                f"the ONNX model keeps {len(external)} tensor(s) in external data files "
                f"({external[0]}, ...); pass base_dir= the folder that holds them, or the path"
            )
        from onnx.external_data_helper import load_external_data_for_model

        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        load_external_data_for_model(copy, str(base_dir))
        model = copy
    return model, model.graph.name or "onnx"


def constants(graph) -> dict[str, np.ndarray]:
    """Float initializers and Constant-node values, by tensor name."""
    numpy_helper = onnx_module().numpy_helper
    out = {}
    for init in graph.initializer:
        if init.data_type in FLOATS:
            out[init.name] = numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.t.data_type in FLOATS:
                    out[node.output[0]] = numpy_helper.to_array(a.t)
    return out


def analyse(model, base_dir: str | Path | None = None) -> OnnxGraph:
    proto, name = load(model, base_dir)
    proto, share = fp32_twin(in_order(proto), onnx_module())  # an FP16 file's values are FP16's own
    g = proto.graph
    inits = {i.name for i in g.initializer}
    graph = OnnxGraph(proto, name, elem=elem_types(proto, onnx_module()), consts=constants(g))
    graph.fp16_source = share
    meta = {p.key: p.value for p in proto.metadata_props}
    if FP32_NODES_KEY in meta:
        graph.fp32 = set(json.loads(meta[FP32_NODES_KEY]))
    graph.inputs = [i.name for i in g.input if i.name not in inits]
    graph.outputs = [o.name for o in g.output]
    taken: dict[str, int] = {}
    for node in g.node:
        floats = [o for o in node.output if o and graph.elem.get(o) in FLOATS]
        if node.op_type == "Constant" or not floats:
            continue
        base = node.name or node.output[0]
        taken[base] = taken.get(base, 0) + 1
        sid = len(graph.sites)
        name = base if taken[base] == 1 else f"{base}#{taken[base]}"
        graph.sites.append(
            SiteInfo(name=name, kind="module", op=node.op_type, module=name, order=sid)
        )
        graph.nodes.append(node)
        graph.events.extend((sid, o) for o in floats)
        for t in node.input:
            graph.consumers.setdefault(t, []).append(sid)
    return graph
