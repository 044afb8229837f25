"""How the planner (``patch/_planner.py``) reads an ONNX graph: each node's kind from the
ONNX op table (``_core/algebra onnx_class``) refined as patch's ``Kind`` by its constant
operands, and the node's initializers as the parameters a module would hold."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fp16lens._core import PatchError
from fp16lens._core.algebra import ONNX_JOINS, Kind, OpClass, onnx_class
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.patch._norm_modules import merge_sites, rename_span
from fp16lens.patch.onnx._graph import OnnxModel, attr
from fp16lens.patch.onnx._norms import Unit, decomposed_norms
from fp16lens.report import Finding, Report

_NORMS = ("LayerNormalization", "GroupNormalization", "InstanceNormalization")
_WEIGHTED = ("Conv", "ConvTranspose", "Gemm")


class OnnxNode(nn.Module):
    """One node's constants as the planner reads a module's (``weight``, ``bias``,
    ``running_mean``, ``running_var``, ``eps``); holds no parameter of its own."""

    def __init__(self, op_type: str, **tensors):
        super().__init__()
        self.op_type = op_type
        for k, v in tensors.items():
            object.__setattr__(self, k, v)


def _tensor(a) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a.astype("float32", copy=True))


class OnnxBinding:
    """The planner's view of an ONNX graph (``TorchBinding`` is a PyTorch model's)."""

    owners: frozenset[str] = frozenset()  # no functional ops: every node is a site of its own

    def __init__(self, m: OnnxModel, frozen_nodes: set[str]):
        self.m, self.frozen_nodes = m, frozen_nodes
        self.units = {u.name: u for u in decomposed_norms(m)}

    @staticmethod
    def mappable(model, report, join, keep, traced) -> bool:
        return True  # a Mul can go before any node input

    @staticmethod
    def is_product(st) -> bool:
        return st.op == "Mul"  # x * g(x) of two activations carries x's scale (build_graph)

    def frozen(self, report: Report) -> set[str]:
        return {
            s
            for s in report.sites
            if getattr(self.m.nodes.get(s), "name", None) in self.frozen_nodes
        }

    def site(self, name: str, st, n_producers: int) -> tuple[str, nn.Module]:
        if name in self.units:
            return Kind.NORM, self._unit_node(self.units[name])
        node = self.m.nodes.get(name)
        if node is None or node.op_type != st.op:
            found = "absent" if node is None else f"a {node.op_type} node"
            raise PatchError(
                f"the report names node {name!r} ({st.op}) but in this graph it is {found}; "
                "the report is from another model: scan this model and patch with its report"
            )
        return node_kind(self.m, node, n_producers), self._node(node)

    def _node(self, node) -> OnnxNode:
        c = lambda i: _tensor(self.m.const(node, i))  # noqa: E731
        op = node.op_type
        if op in _WEIGHTED:
            return OnnxNode(op, weight=c(1), bias=c(2))
        if op == "MatMul":
            return OnnxNode(op, weight=c(1) if c(1) is not None else c(0), bias=None)
        if op == "BatchNormalization":
            return OnnxNode(
                op,
                weight=c(1),
                bias=c(2),
                running_mean=c(3),
                running_var=c(4),
                eps=float(attr(node, "epsilon", 1e-5)),
            )
        if op in _NORMS:
            return OnnxNode(op, weight=c(1), bias=c(2), eps=float(attr(node, "epsilon", 1e-5)))
        return OnnxNode(op)

    def _unit_node(self, u: Unit) -> OnnxNode:
        get = lambda ref: None if ref is None else _tensor(self.m.const(*ref))  # noqa: E731
        eps = self.m.const(*u.eps)
        assert eps is not None  # a Unit's eps is a constant (_norms.py finds it so)
        return OnnxNode(
            "decomposed norm", weight=get(u.weight), bias=get(u.bias), eps=float(eps.reshape(-1)[0])
        )

    def aliases(self) -> dict[str, str]:
        """Each node of a decomposed norm -> the norm's site (its findings move there)."""
        return {s: u.name for u in self.units.values() for s in u.members if s != u.name}

    def contract(self, report: Report) -> Report:
        """Each decomposed norm one NORM site; its stored (x-mean)^2 an internal finding of
        the norm (as a PyTorch LayerNorm's); constants named by their role at a weighted node."""
        report = _drop_constants(report, self.m)
        rename = {s: u.name for u in self.units.values() for s in u.members}
        report = _merge(report, rename, self.units) if rename else report
        return dataclasses.replace(report, findings=[self._role(f) for f in report.findings])

    def _role(self, f: Finding) -> Finding:
        node = self.m.nodes.get(f.site)
        if (
            f.mechanism != Mechanism.PARAMETER
            or node is None
            or node.op_type not in (*_WEIGHTED, "MatMul")
        ):
            return f
        slots = [i for i, t in enumerate(node.input) if t == f.tensor]
        role = "bias" if slots == [2] else "weight" if slots else f.tensor
        return dataclasses.replace(f, tensor=role)


def node_kind(m: OnnxModel, node, n_producers: int) -> str:
    op = node.op_type
    const = [m.const(node, i) is not None for i in range(len(node.input))]
    if op in _WEIGHTED:  # weight and bias initializers, the data an activation
        ok = (
            len(const) > 1
            and const[1]
            and not const[0]
            and (len(const) < 3 or const[2] or not node.input[2])
        )
        return Kind.LINEAR if ok else Kind.BLOCK
    if op == "MatMul":
        return Kind.LINEAR if sum(const) == 1 else Kind.BLOCK
    if op == "BatchNormalization":
        ok = (
            len(const) == 5
            and all(const[1:])
            and len(node.output) == 1
            and not attr(node, "training_mode", 0)
        )
        return Kind.BN if ok else Kind.BLOCK
    if op in _NORMS:
        return Kind.NORM
    if op in ONNX_JOINS:  # a constant operand takes the site's scale (a bias)
        return Kind.JOIN if n_producers > 1 else Kind.HOMOG
    if op == "Mul" and any(const) and n_producers <= 1:
        return Kind.HOMOG
    if op == "Div" and len(const) == 2 and const[1] and not const[0]:
        return Kind.HOMOG
    attrs = {"mode": attr(node, "mode", "nearest" if op == "Resize" else "constant")}
    if op == "Pad":
        value = m.const(node, 2)
        if len(node.input) > 2 and node.input[2] and value is None:
            return Kind.BLOCK  # a computed pad value
        attrs["value"] = (
            float(value.reshape(-1)[0]) if value is not None else attr(node, "value", 0.0)
        )
    return Kind.HOMOG if onnx_class(op, attrs) == OpClass.HOMOGENEOUS else Kind.BLOCK


def _drop_constants(report: Report, m: OnnxModel) -> Report:
    """Without the sites that only pass a constant on (an exporter's Identity of a shared
    initializer): the constant is a parameter of the node reading it, a finding on it too."""
    gone = m.const_sites & report.sites.keys()
    if not gone:
        return report
    site_of = {id(n): s for s, n in m.nodes.items()}
    reader = {}
    for s in gone:
        readers = [site_of.get(id(n)) for n, _ in m.readers.get(m.nodes[s].output[0], [])]
        reader[s] = next((r for r in readers if r is not None and r not in gone), s)
    findings = [dataclasses.replace(f, site=reader.get(f.site, f.site)) for f in report.findings]
    return dataclasses.replace(
        report,
        sites={n: st for n, st in report.sites.items() if n not in gone},
        edges=[(p, c) for p, c in report.edges if p not in gone and c not in gone],
        findings=findings,
    )


def _merge(report: Report, rename: dict[str, str], units: dict[str, Unit]) -> Report:
    def r(site: str) -> str:
        return rename.get(site, site)

    sites, edges = merge_sites(
        report,
        rename,
        lambda unit: dataclasses.replace(
            report.sites[units[unit].output], name=unit, op="decomposed norm", module=unit
        ),
    )
    spans, findings, inside = [], [], set()
    for sp in report.spans:
        names = {r(s) for s in sp.sites}
        if len(names) == 1 and next(iter(names)) in units:  # only the norm's own (x-mean)^2
            inside.add(next(iter(names)))
            findings.append(
                Finding(
                    r(sp.start),
                    Mechanism.INTERNAL,
                    sp.peak,
                    "(x-mean)^2 of a decomposed norm beyond FP16",
                    kind=FindingKind.NORM_VARIANCE,
                    tensor="(x-mean)^2",
                )
            )
            continue
        spans.append(rename_span(sp, rename))
    for f in report.findings:
        if f.mechanism == Mechanism.OUTPUT and r(f.site) in inside:
            continue  # the span's own finding, now internal
        findings.append(dataclasses.replace(f, site=r(f.site)))
    return dataclasses.replace(report, sites=sites, edges=edges, spans=spans, findings=findings)
