"""A plan applied to a copy of an ONNX graph: the rules of ``patch/_rules.py`` on the
nodes' constants (a constant another node reads too is copied first), a Mul by an exact
power of two before a join operand that is cut, Muls around each FP32 island, and the
islands' node names in ``metadata_props[FP32_NODES_KEY]``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from fp16lens._core.onnx_types import outer_names, rename_reads, subgraphs
from fp16lens.patch._plan import Plan, Reparam
from fp16lens.patch._rules import (
    bn_affine,
    bn_affine_stats,
    scale_bn,
    scale_linear,
    scale_norm_eps,
)
from fp16lens.patch.onnx._graph import FLOAT_TYPES, OnnxModel, attr, onnx_module
from fp16lens.patch.onnx._norms import Unit

if TYPE_CHECKING:  # onnx is optional (and not followed by mypy: its names are Any)
    from onnx import NodeProto

_TAG = "__fp16lens"


class Editor:
    """Edits of one graph: constants written per (node, slot), nodes inserted, new names."""

    def __init__(self, m: OnnxModel):
        self.m, self.g = m, m.proto.graph
        self.onnx = onnx_module()
        self.added: list[tuple[NodeProto, NodeProto]] = []  # (node before which, new node)
        self.count = 0

    def fresh(self, base: str) -> str:
        self.count += 1
        return f"{base}{_TAG}{self.count}"

    def get(self, node, slot: int) -> torch.Tensor | None:
        a = self.m.const(node, slot)
        return None if a is None else torch.from_numpy(np.array(a, dtype=np.float64))

    def put(self, node, slot: int, value: torch.Tensor | float) -> None:
        """Input ``slot`` of ``node`` holds ``value`` (in the constant's dtype); the constant
        is rewritten where this slot is its only reader, else a new initializer is made."""
        name = node.input[slot]
        old = self.m.consts[name]
        array = (
            np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value)
            .astype(old.dtype)
            .reshape(old.shape)
        )
        readers = self.m.readers.get(name, [])
        if name in self.m.inits and len(readers) == 1 and name not in self.m.outputs:
            init = next(i for i in self.g.initializer if i.name == name)
            init.CopyFrom(self.onnx.numpy_helper.from_array(array, name))
        else:  # shared, or a Constant node's value: this node gets its own copy
            name = self.fresh(name)
            self.g.initializer.append(self.onnx.numpy_helper.from_array(array, name))
            node.input[slot] = name
            self.m.readers.setdefault(name, []).append((node, slot))
            self.m.inits.add(name)
        self.m.consts[name] = array

    def set_attr(self, node, name: str, value: float) -> None:
        for a in node.attribute:
            if a.name == name:
                a.f = value
                return
        node.attribute.append(self.onnx.helper.make_attribute(name, value))

    def multiply(self, tensor: str, factor: float, before) -> NodeProto:
        """A new Mul(tensor, factor) placed before node ``before``; returns the Mul."""
        elem = self.m.elem.get(tensor, 1)
        dtype = self.onnx.helper.tensor_dtype_to_np_dtype(elem if elem in FLOAT_TYPES else 1)
        const = self.fresh(f"{tensor}_factor")
        self.g.initializer.append(
            self.onnx.numpy_helper.from_array(np.array(factor, dtype=dtype), const)
        )
        out = self.fresh(tensor)
        node = self.onnx.helper.make_node(
            "Mul", [tensor, const], [out], name=self.fresh(f"{tensor}_mul")
        )
        self.added.append((before, node))
        return node

    def commit(self) -> None:
        """Insert the new nodes, each before the node it feeds (graph order stays topological)."""
        before: dict[int, list] = {}
        for anchor, node in self.added:
            before.setdefault(id(anchor), []).append(node)
        nodes = []
        for node in self.g.node:
            nodes += _ordered(before.pop(id(node), []))
            nodes.append(node)
        nodes += _ordered(before.pop(id(None), []))  # after the last node
        read = {t for n in nodes for t in n.input} | self.m.outputs
        nodes = [
            n
            for n in nodes
            if not (
                n.op_type == "Identity" and n.input[0] in self.m.consts and not set(n.output) & read
            )
        ]  # constants no longer read
        del self.g.node[:]
        self.g.node.extend(nodes)


def _ordered(inserted: list) -> list:
    """The nodes inserted before one node, each after those of them it reads (an island's
    output multiply before the next island's input multiply of that output), else in the
    order they were made."""
    made = {o for n in inserted for o in n.output}
    out: list = []
    pending = list(inserted)
    while pending:
        done = {o for n in out for o in n.output}
        ready = [n for n in pending if all(i not in made or i in done for i in n.input)]
        if not ready:  # a cycle cannot come from multiplies; keep the order rather than loop
            return out + pending
        out += ready
        pending = [n for n in pending if all(n is not r for r in ready)]
    return out


def apply(m: OnnxModel, plan: Plan, units: dict[str, Unit]) -> list[str]:
    """Rewrite ``m.proto`` in place; returns the node names that must stay FP32."""
    ed = Editor(m)
    for r in plan.reparametrized:
        if r.module in units:
            _decomposed(ed, units[r.module], r)
        else:
            _RULES[r.rule](ed, m.nodes[r.module], r)
    for region in plan.regions:  # a constant added to a scaled tensor (a bias) takes its scale
        for s in region.sites:
            if s not in units and m.nodes[s].op_type in ("Add", "Sub", "Concat"):
                node = m.nodes[s]
                for slot in range(len(node.input)):
                    if (value := ed.get(node, slot)) is not None:
                        ed.put(node, slot, value / region.factor)
    for mul in plan.multiplies:
        join = m.nodes[mul.site]
        for p in mul.cut:
            tensor = next(t for t in m.nodes[p].output if t in join.input)
            node = ed.multiply(tensor, mul.factor, join)
            for slot, t in enumerate(join.input):
                if t == tensor:
                    join.input[slot] = node.output[0]
    fp32 = [n for i in plan.islands for n in _island(ed, units, i, plan.regions)]
    ed.commit()
    return fp32


def _island(ed: Editor, units: dict[str, Unit], island, regions) -> list[str]:
    m = ed.m
    sites = units[island.module].members if island.module in units else (island.module,)
    nodes = [m.nodes[s] for s in sites]
    for s, node in zip(sites, nodes):
        node.name = node.name or s  # the export finds islands by node name
    made = [n.name for n in nodes]
    own = {o for n in nodes for o in n.output}
    if island.in_scale != 1:
        for node in nodes:
            for slot, t in enumerate(node.input):
                if t and t not in own and t not in m.consts and m.elem.get(t) in FLOAT_TYPES:
                    mul = ed.multiply(t, island.in_scale, node)  # after t's producer
                    node.input[slot] = mul.output[0]
                    made.append(mul.name)
            made += _unscale_branch_reads(ed, units, island, node, regions)
    if island.out_scale != 1:
        last = nodes[-1]
        for i, t in enumerate(last.output):
            if t and m.elem.get(t) in FLOAT_TYPES:
                inner = ed.fresh(t)
                last.output[i] = inner
                mul = ed.onnx.helper.make_node(
                    "Mul", [inner, ed.fresh(f"{t}_factor")], [t], name=ed.fresh(f"{t}_mul")
                )
                dtype = ed.onnx.helper.tensor_dtype_to_np_dtype(m.elem[t])
                ed.g.initializer.append(
                    ed.onnx.numpy_helper.from_array(
                        np.array(1.0 / island.out_scale, dtype=dtype), mul.input[1]
                    )
                )
                ed.added.append((_next(ed, last), mul))
                made.append(mul.name)
    return made


def _unscale_branch_reads(ed: Editor, units: dict[str, Unit], island, node, regions) -> list[str]:
    """An If (Loop, Scan) island: the scaled tensors its branches read from the main graph
    (those of the regions it exits) are multiplied back before it."""
    reads = {t for g in subgraphs(node) for t in outer_names(g)}
    if not reads:
        return []
    sites = [s for r in regions if island.module in r.exits for s in r.sites]
    members = [x for s in sites for x in (units[s].members if s in units else (s,))]
    scaled = {t for x in members for t in ed.m.nodes[x].output}
    # an island before this one hands its output on through a Mul of its own (out_scale):
    # the branches read that Mul's output, the name the tensor had
    handed = {mul.input[0]: mul.output[0] for _, mul in ed.added if mul.op_type == "Mul"}
    scaled |= {handed[t] for t in scaled if t in handed}
    muls = {t: ed.multiply(t, island.in_scale, node) for t in sorted(reads & scaled)}
    for g in subgraphs(node):
        rename_reads(g, {t: mul.output[0] for t, mul in muls.items()})
    return [mul.name for mul in muls.values()]


def _next(ed: Editor, node):
    """The node after ``node`` in graph order (None: the end)."""
    nodes = list(ed.g.node)
    i = next(k for k, n in enumerate(nodes) if n is node)
    return nodes[i + 1] if i + 1 < len(nodes) else None


def _linear(ed: Editor, node, r: Reparam) -> None:
    slot = 1 if node.op_type != "MatMul" or ed.m.const(node, 1) is not None else 0
    bias_slot = 2 if node.op_type != "MatMul" and len(node.input) > 2 and node.input[2] else None
    w, b = scale_linear(
        ed.get(node, slot), None if bias_slot is None else ed.get(node, bias_slot), r.s_in, r.s_out
    )
    ed.put(node, slot, w)
    if b is not None and bias_slot is not None:  # b: scale_linear's bias for the bias slot
        ed.put(node, bias_slot, b)


def _bn_args(
    ed: Editor, node
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None, torch.Tensor | None]:
    """mean, var, eps, weight, bias of a BatchNormalization whose inputs are constants."""
    mean, var = ed.get(node, 3), ed.get(node, 4)
    assert mean is not None and var is not None  # the binding's BN kind: constant statistics
    return mean, var, float(attr(node, "epsilon", 1e-5)), ed.get(node, 1), ed.get(node, 2)


def _bn_scale(ed: Editor, node, r: Reparam) -> None:
    mean, var, eps, w, b = scale_bn(*_bn_args(ed, node), r.s_in, r.s_out)
    for slot, v in ((3, mean), (4, var), (1, w), (2, b)):
        ed.put(node, slot, v)
    ed.set_attr(node, "epsilon", eps)


def _bn_affine(ed: Editor, node, r: Reparam) -> None:
    """The exact affine form, its epsilon kept (``bn_affine_stats``)."""
    args = _bn_args(ed, node)
    scale, shift = bn_affine(*args, r.s_in, r.s_out)
    var, c = bn_affine_stats(args[2])
    ed.put(node, 1, scale * c)
    ed.put(node, 2, shift)
    ed.put(node, 3, torch.zeros_like(scale))
    ed.put(node, 4, torch.full_like(scale, var))


def _norm(ed: Editor, node, r: Reparam) -> None:
    ed.set_attr(node, "epsilon", scale_norm_eps(float(attr(node, "epsilon", 1e-5)), r.s_in))
    _norm_out(ed, [(node, 1), (node, 2)], r.s_out)


def _norm_out(ed: Editor, refs, s_out: float) -> None:
    if s_out == 1:
        return
    for node, slot in refs:
        if slot < len(node.input) and (value := ed.get(node, slot)) is not None:
            ed.put(node, slot, value / s_out)


def _decomposed(ed: Editor, u: Unit, r: Reparam) -> None:
    eps_node, eps_slot = u.eps
    eps = ed.get(eps_node, eps_slot)
    assert eps is not None  # a Unit's eps is a constant (_norms.py finds it so)
    ed.put(eps_node, eps_slot, eps / (r.s_in * r.s_in))
    _norm_out(ed, [ref for ref in (u.weight, u.bias) if ref is not None], r.s_out)


_RULES = {"linear": _linear, "bn-scale": _bn_scale, "bn-affine": _bn_affine, "norm": _norm}
