"""Strongly typed FP16: every float tensor FP16 except the FP32 islands, Casts at boundaries.

Our own small converter (no onnxconverter-common): plan each node's precision from its
schema (``_typing``), convert initializers and constants with range checks, insert one
Cast per (tensor, dtype) where a producer and a consumer disagree, and keep the float
graph inputs/outputs in ``io_dtype``.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fp16lens._core import onnx_large
from fp16lens._core.onnx_types import outer_names, rename_reads, subgraphs
from fp16lens.export._artifact import default_opset
from fp16lens.export._naming import NodeOrigin, stamp
from fp16lens.export._ranges import (
    clamp_mask_constants,
    guards_summary,
    subnormal_summary,
    to_fp16_checked,
    vanished_guard,
)
from fp16lens.export._typing import FLOAT, FLOAT16, NodeTyping, type_node

_TAG = {FLOAT: "fp32", FLOAT16: "fp16"}
_BIAS_SLOT = {
    op: 2
    for op in (
        "Conv",
        "ConvTranspose",
        "Gemm",
        "BatchNormalization",
        "InstanceNormalization",
        "LayerNormalization",
        "GroupNormalization",
    )
}
_MEAN_SLOT = {"BatchNormalization": 3}
"""A running mean is subtracted from the values it joins: its loss is a bias's."""


@dataclass
class Fp16Result:
    model: object
    fp32_nodes: list[str]
    warnings: list[str] = field(default_factory=list)


def elem_types(model) -> dict[str, int]:
    """Element type of every tensor of a shape-inferred ``model``."""
    g = model.graph
    elem = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    elem.update({i.name: i.data_type for i in g.initializer})
    return elem


def convert_fp16(
    model,
    island: set[str],
    origins: dict[str, NodeOrigin],
    io_dtype: str,
    fp32_out: AbstractSet[str] = frozenset(),
) -> Fp16Result:
    """Rewrite the FP32 ``model`` in place into strongly typed FP16; returns it with notes.
    A graph output produced by a node of ``fp32_out`` (an island that hands its output on in
    FP32: its values may pass FP16) stays FP32 whatever ``io_dtype`` says."""
    inferred = onnx_large.infer_shapes(onnx, model)
    elem = elem_types(inferred)
    opset = default_opset(model)
    g = model.graph
    del g.value_info[:]
    g.value_info.extend(inferred.graph.value_info)
    typing = {n.name: type_node(n, opset, elem, n.name in island) for n in g.node}
    result = Fp16Result(model, [n.name for n in g.node if typing[n.name].fp32])
    _keep_fp32_constants(g, typing)
    result.warnings += [
        f"node {n.name!r} ({n.op_type}) runs in FP32: {typing[n.name].forced}"
        for n in g.node
        if typing[n.name].forced and n.name not in island
    ]
    rw = _Rewriter(model, elem, typing, origins, result.warnings)
    nodes = all(rw._own(n) for n in g.node)  # an ONNX source without a module map
    rw.inputs(io_dtype)
    rw.initializers()
    rw.nodes()
    rw.outputs(io_dtype, fp32_out)
    rw.value_info()
    summary = subnormal_summary(rw.converted, nodes=nodes)
    if summary:
        result.warnings.append(summary)
    if rw.guards:
        result.warnings.append(guards_summary(rw.guards, nodes=nodes))
    return result


def _keep_fp32_constants(graph, typing: dict[str, NodeTyping]) -> None:
    """A Constant node read only where FP32 is required (Resize's scales, Range's bounds,
    an FP32 island) stays FP32: no rounding, and no Cast between it and its readers; one
    read by nothing (a rewrite left it behind) is not converted either."""
    readers: dict[str, list[tuple[str, int | None]]] = {}
    for n in graph.node:
        for i, t in enumerate(n.input):
            readers.setdefault(t, []).append((n.name, i))
        for t in {t for body in subgraphs(n) for t in outer_names(body)}:
            readers.setdefault(t, []).append((n.name, None))  # a body reads it, in FP32
    outputs = {o.name for o in graph.output}
    for n in graph.node:
        if (
            n.op_type != "Constant"
            or typing[n.name].outputs != (FLOAT16,)
            or n.output[0] in outputs
        ):
            continue
        wants = [_wanted(typing[r], i) for r, i in readers.get(n.output[0], [])]
        if all(w == FLOAT for w in wants):  # no reader at all: left as it is
            typing[n.name] = NodeTyping(True, (), (FLOAT,))


def _wanted(typing: NodeTyping, i: int | None) -> int | None:
    if i is None:
        return FLOAT
    return typing.inputs[i] if i < len(typing.inputs) else None


def _nodes(nodes) -> str:
    return ", ".join(f"{n.op_type} {n.name!r}" for n in nodes[:3]) + (
        f" and {len(nodes) - 3} more" if len(nodes) > 3 else ""
    )


def _explicit_default_dtype(node) -> None:
    """An op whose output is FP32 by an attribute's default (ConstantOfShape without
    ``value`` makes float32 zeros; RandomNormal/RandomUniform without ``dtype``) gets the
    attribute spelled out in FP16."""
    names = {a.name for a in node.attribute}
    if node.op_type == "ConstantOfShape" and "value" not in names:
        zero = numpy_helper.from_array(np.zeros(1, dtype=np.float16))
        node.attribute.append(helper.make_attribute("value", zero))
    elif node.op_type in ("RandomNormal", "RandomUniform") and "dtype" not in names:
        node.attribute.append(helper.make_attribute("dtype", FLOAT16))


class _Rewriter:
    """One pass over the graph: inputs, initializers, nodes (with Casts), outputs, value_info."""

    def __init__(self, model, elem, typing: dict[str, NodeTyping], origins, warnings):
        self.g = model.graph
        self.elem, self.typing, self.origins, self.warnings = elem, typing, origins, warnings
        self.actual: dict[str, int] = {}  # float tensor -> dtype in the new graph
        self.alias: dict[tuple[str, int], str] = {}  # (tensor, dtype) -> tensor holding it
        self.producer = {t: n for n in self.g.node for t in n.output}
        self.graph_outputs = {o.name for o in self.g.output}
        self.body_reads = {t for n in self.g.node for b in subgraphs(n) for t in outer_names(b)}
        self.consumers: dict[str, list] = {}
        for n in self.g.node:
            for t in n.input:
                self.consumers.setdefault(t, []).append(n)
        self.shapes: dict[str, str] = {}  # new tensor -> tensor whose shape it has
        self.converted: list = []  # (name, size, RangeIssues, additive) of every array made FP16
        self.guards: list[str] = []  # eps and clip bounds FP16 makes 0 (``vanished_guard``)

    def _origin(self, node) -> NodeOrigin:
        return self.origins.get(node.name, NodeOrigin(None))

    def _own(self, node) -> bool:
        """Whether ``node`` is its own unit (a node of an ONNX source without a module map,
        ``_onnx_in.node_origins``): the user keeps it FP32 by its name, fp32_nodes."""
        return self._origin(node).modules == (node.name,)

    # -- graph inputs and initializers -------------------------------------------------
    def inputs(self, io_dtype: str) -> None:
        for v in self.g.input:
            if v.type.tensor_type.elem_type == FLOAT:
                dtype = FLOAT16 if io_dtype == "fp16" else FLOAT
                v.type.tensor_type.elem_type = dtype
                self.actual[v.name] = dtype

    def initializers(self) -> None:
        for init in list(self.g.initializer):
            if init.data_type != FLOAT:
                continue
            needs = self._needs(init.name)
            if not needs and init.name not in self.graph_outputs:
                continue  # read by nothing (left behind by a rewrite): left as it is
            primary = FLOAT16 if FLOAT16 in needs else FLOAT
            array = numpy_helper.to_array(init)
            mods = self._modules_of(self.consumers.get(init.name, []))
            if primary == FLOAT16:
                self._replace(
                    init, self._half(init.name, array, mods, self._additive(init.name), init.name)
                )
            self.actual[init.name] = primary
            if len(needs) == 2:
                other = f"{init.name}__{_TAG[FLOAT]}"
                self.g.initializer.append(numpy_helper.from_array(array.astype(np.float32), other))
                self.alias[(init.name, FLOAT)] = other

    def _needs(self, name: str) -> set[int]:
        needs = {FLOAT} if name in self.body_reads else set()
        for n in self.consumers.get(name, []):
            req = self.typing[n.name].inputs
            needs.update(req[i] for i, t in enumerate(n.input) if t == name and req[i] is not None)
        return needs

    def _additive(self, name: str) -> bool:
        """Whether every use of ``name`` adds it to the values it joins (a bias slot, an
        Add/Sub operand, a BatchNormalization's running mean)."""
        uses = [
            (n.op_type, i)
            for n in self.consumers.get(name, [])
            for i, t in enumerate(n.input)
            if t == name
        ]
        return bool(uses) and all(
            op in ("Add", "Sub") or i in (_BIAS_SLOT.get(op), _MEAN_SLOT.get(op)) for op, i in uses
        )

    def _added(self, node) -> bool:
        """Whether a Constant node's value is only added (an eps, a bias): ``_additive``."""
        return node.op_type == "Constant" and self._additive(node.output[0])

    def _half(
        self,
        name: str,
        array: np.ndarray,
        modules: list[str],
        additive: bool = False,
        tensor: str | None = None,
    ) -> np.ndarray:
        readers = self.consumers.get(tensor, []) if tensor else []
        if readers and all(self._own(n) for n in readers):
            modules = []  # an ONNX source's nodes, each its own unit: the nodes name it
        half, issues = to_fp16_checked(name, array, modules, [n.name for n in readers])
        owners = [m for m in modules if m]  # '' is the model itself: the nodes say more
        label = (
            f"{name} of {', '.join(map(repr, owners))}"
            if owners
            else f"{name} (read by {_nodes(readers)})"
            if readers
            else name
        )
        guard = vanished_guard(array, readers)
        if guard is not None:
            self.guards.append(f"{label}: {guard}")
            return half
        clamped = clamp_mask_constants(array)[1]
        if clamped:
            self.warnings.append(
                f"{label}: {clamped} masking constant(s) of |v| >= 1e30 (finfo(float32).min) "
                "clamped to +-65504 for FP16"
            )
        self.converted.append((label, int(np.size(array)), issues, additive))
        return half

    @staticmethod
    def _replace(tensor, array: np.ndarray) -> None:
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))

    def _readers(self, node) -> list[str]:
        """The modules a Constant's value belongs to: those of the nodes reading it."""
        readers = [c for t in node.output for c in self.consumers.get(t, [])]
        return self._modules_of(readers if node.op_type == "Constant" and readers else [node])

    def _modules_of(self, nodes) -> list[str]:
        mods = [m for n in nodes for m in self._origin(n).modules]
        return list(dict.fromkeys(mods))

    # -- nodes ---------------------------------------------------------------------------
    def nodes(self) -> None:
        new_nodes: list = []  # NodeProtos
        for node in self.g.node:
            typing = self.typing[node.name]
            for i, name in enumerate(node.input):
                want = typing.inputs[i] if i < len(typing.inputs) else None
                if want is None or self.actual.get(name, want) == want:
                    continue
                node.input[i] = self._cast(name, want, node, new_nodes)
            if not typing.fp32:
                self._retype_attributes(node)
            self._feed_bodies(node, new_nodes)
            for name, dtype in zip(node.output, typing.outputs):
                if dtype is not None:
                    self.actual[name] = dtype
            new_nodes.append(node)
        del self.g.node[:]
        self.g.node.extend(new_nodes)

    def _feed_bodies(self, node, new_nodes: list) -> None:
        """A control-flow body stays FP32: the outer tensors it reads that are FP16 now are
        read through a Cast to FP32 placed before the node."""
        for body in subgraphs(node):
            for name in sorted(outer_names(body)):
                if self.actual.get(name) == FLOAT16:
                    rename_reads(body, {name: self._cast(name, FLOAT, node, new_nodes)})

    def _cast(self, name: str, dtype: int, consumer, new_nodes: list) -> str:
        key = (name, dtype)
        if key not in self.alias:
            out = f"{name}__{_TAG[dtype]}"
            cast = helper.make_node("Cast", [name], [out], name=f"{out}__cast", to=dtype)
            producer = self.producer.get(name)
            origin = self._origin(producer) if producer is not None else self._origin(consumer)
            stamp(cast, NodeOrigin(origin.module, origin.modules))
            new_nodes.append(cast)
            self.alias[key] = out
            self.actual[out] = dtype
            self.shapes[out] = name
        return self.alias[key]

    def _retype_attributes(self, node) -> None:
        for attr in node.attribute:
            if attr.name in ("to", "dtype") and attr.type == attr.INT and attr.i == FLOAT:
                attr.i = FLOAT16
            elif attr.name == "value" and attr.type == attr.TENSOR and attr.t.data_type == FLOAT:
                array = numpy_helper.to_array(attr.t)
                half = self._half(
                    node.name, array, self._readers(node), self._added(node), node.output[0]
                )
                self._replace(attr.t, half)
        if node.op_type == "Constant":
            self._constant_scalars(node)
        _explicit_default_dtype(node)

    def _constant_scalars(self, node) -> None:
        for attr in list(node.attribute):
            if attr.name in ("value_float", "value_floats"):
                values = np.array(
                    attr.f if attr.name == "value_float" else list(attr.floats), dtype=np.float32
                )
                half = self._half(
                    node.name, values, self._readers(node), self._added(node), node.output[0]
                )
                node.attribute.remove(attr)
                node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(half)))

    # -- graph outputs and value_info ----------------------------------------------------
    def outputs(self, io_dtype: str, fp32_out: AbstractSet[str] = frozenset()) -> None:
        for v in self.g.output:
            have = self.actual.get(v.name)
            if have is None or v.type.tensor_type.elem_type not in (FLOAT, FLOAT16):
                continue
            want = FLOAT16 if io_dtype == "fp16" else FLOAT
            producer = self.producer.get(v.name)
            if (
                want == FLOAT16
                and have == FLOAT
                and producer is not None
                and producer.name in fp32_out
            ):
                want = FLOAT
                self.warnings.append(
                    f"output {v.name!r} stays FP32 (io_dtype='fp16'): the FP32 island that produces "
                    "it hands its values on in FP32, as the patched model does under .half()"
                )
            if have != want:
                self._recast_output(v.name, have, want)
            v.type.tensor_type.elem_type = want

    def _recast_output(self, name: str, have: int, want: int) -> None:
        inner = f"{name}__{_TAG[have]}"
        for node in self.g.node:
            node.output[:] = [inner if t == name else t for t in node.output]
            node.input[:] = [inner if t == name else t for t in node.input]
        producer = self.producer[name]
        cast = helper.make_node("Cast", [inner], [name], name=f"{name}__cast", to=want)
        stamp(cast, self._origin(producer))
        self.g.node.append(cast)
        self.actual[inner], self.actual[name] = have, want
        self.shapes[inner] = name

    def value_info(self) -> None:
        known = {v.name: v for v in [*self.g.output, *self.g.value_info]}
        for out, source in self.shapes.items():
            if source in known and out not in {v.name for v in self.g.value_info}:
                info = self.g.value_info.add()
                info.CopyFrom(known[source])
                info.name = out
                known[out] = info
        for v in self.g.value_info:
            if v.name in self.actual and v.type.tensor_type.elem_type in (FLOAT, FLOAT16):
                v.type.tensor_type.elem_type = self.actual[v.name]
