"""Norms an exporter decomposed (a LayerNorm/GroupNorm below opset 17/18, an RMS norm):
ReduceMean -> Sub -> Pow(2) -> ReduceMean -> Add(eps) -> Sqrt -> Div [-> Mul(gamma) ->
Add(beta)], or without the mean for an RMS norm. Recognized by what the nodes compute, so
the planner sees one invariant norm site (named after its Pow, where the scan reports
the stored (x-mean)^2) whose eps constant takes eps/p^2 like a LayerNormalization's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp16lens.patch.onnx._graph import OnnxModel

if TYPE_CHECKING:  # onnx is optional (and not followed by mypy: its names are Any)
    from onnx import NodeProto


@dataclass(frozen=True)
class Unit:
    name: str  # the Pow's site
    members: tuple[str, ...]  # sites, the Pow's included
    output: str  # the site whose output leaves the unit
    eps: tuple[NodeProto, int]  # (Add node, slot) holding eps
    weight: tuple[NodeProto, int] | None  # (Mul node, slot) holding gamma
    bias: tuple[NodeProto, int] | None  # (Add node, slot) holding beta


def _other(m: OnnxModel, node, tensor: str) -> int | None:
    """The slot of ``node``'s float constant operand beside ``tensor``, or None."""
    if len(node.input) != 2 or tensor not in node.input:
        return None
    slot = 1 - list(node.input).index(tensor)
    return slot if m.const(node, slot) is not None else None


def _match(m: OnnxModel, pow_node) -> dict | None:
    exp = m.const(pow_node, 1)
    if exp is None or exp.size != 1 or float(exp.reshape(-1)[0]) != 2.0:
        return None
    d = pow_node.input[0]
    nodes = [pow_node]
    sub = m.producer.get(d)
    mean = m.producer.get(sub.input[1]) if sub is not None and sub.op_type == "Sub" else None
    x = d  # an RMS norm: d = x
    if (
        sub is not None
        and mean is not None
        and mean.op_type == "ReduceMean"
        and mean.input[0] == sub.input[0]
        and m.sole_reader(mean.output[0]) is sub
    ):  # a LayerNorm: d = x - mean(x)
        nodes = [mean, sub, pow_node]
        x = sub.input[0]
    var = m.sole_reader(pow_node.output[0], "ReduceMean")
    add = var and m.sole_reader(var.output[0], "Add")
    eps = add and _other(m, add, var.output[0])
    sqrt = add and eps is not None and m.sole_reader(add.output[0], "Sqrt")
    div = sqrt and m.sole_reader(sqrt.output[0], "Div")
    if not (sqrt and div) or list(div.input) != [d, sqrt.output[0]]:  # div implies sqrt
        return None
    if len(nodes) > 1 and any(n is not pow_node and n is not div for n, _ in m.readers.get(d, [])):
        return None  # x - mean read outside the norm
    nodes += [var, add, sqrt, div]
    found = {"nodes": nodes, "eps": (add, eps), "weight": None, "bias": None, "x": x}
    mul = m.sole_reader(div.output[0], "Mul")
    slot = mul and _other(m, mul, div.output[0])
    if slot is not None and mul:
        nodes.append(mul)
        found["weight"] = (mul, slot)
        beta = m.sole_reader(mul.output[0], "Add")
        bslot = beta and _other(m, beta, mul.output[0])
        if bslot is not None and beta:
            nodes.append(beta)
            found["bias"] = (beta, bslot)
    return found


def decomposed_norms(m: OnnxModel) -> list[Unit]:
    site_of = {id(n): s for s, n in m.nodes.items()}
    units = []
    for name, node in m.nodes.items():
        if node.op_type != "Pow":
            continue
        found = _match(m, node)
        if found is None or not all(id(n) in site_of for n in found["nodes"]):
            continue
        members = tuple(site_of[id(n)] for n in found["nodes"])
        units.append(Unit(name, members, members[-1], found["eps"], found["weight"], found["bias"]))
    return units
