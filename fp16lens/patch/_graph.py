"""The report's site dataflow as a graph, and the scale classes over it.

A scale class is a set of sites whose outputs must carry the same scale: a homogeneous
op carries its input's scale, a join needs equal scales on all operands, and a module
called on several inputs (a reused conv) needs them equally scaled too. Classes are found
with union-find over the report's (site-level) edges. A site reused in several places
merges its callers' classes: conservative, still exact.

A power (``x ** 2``, ``sqrt``) joins its input's class with a degree: the union-find is
weighted, each site's scale being the class's p raised to the site's exponent (``weight``):
stft -> x**2 -> add -> sqrt carries p, p^2, p^2, p. A join whose operands arrive with
different exponents (x + x**2) is a conflict: its class carries no scale.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import torch
from torch import nn

from fp16lens._core import PatchError
from fp16lens._core.algebra import (
    Kind,
    OpClass,
    aten_class,
    degree,
    input_linear_weight,
    is_join,
    is_product,
    module_kind,
    op_kind,
    output_linear_child,
    product_carrier,
)
from fp16lens._core.sites import is_island
from fp16lens.patch._fx_read import (
    FunctionalParams,
    constant_factor,
    functional_params,
    parameter_operands,
)
from fp16lens.patch._norm_modules import contract
from fp16lens.report import Report


@dataclass
class SiteGraph:
    producers: dict[str, list[str]]
    consumers: dict[str, list[str]]
    kinds: dict[str, str]
    modules: dict[str, nn.Module]  # module sites only
    frozen: set[str] = field(default_factory=set)  # sites inside FP32 islands of an earlier patch
    cuts: set[tuple[str, str]] = field(default_factory=set)  # (producer, join): a multiply
    parent: dict[str, str] = field(default_factory=dict)  # union-find
    owners: Collection[str] = field(
        default_factory=set
    )  # every module name: hosts of functional ops
    ops: dict[str, str] = field(default_factory=dict)  # functional sites: aten name (degrees)
    rel: dict[str, Fraction] = field(default_factory=dict)  # exponent relative to the parent
    conflicts: set[str] = field(default_factory=set)  # sites whose class got two exponents
    carries: dict[str, str] = field(default_factory=dict)  # product x * g(x) -> x (its scale)
    params: dict[str, tuple[str, ...]] = field(default_factory=dict)  # join -> parameter operands
    hosts: dict[str, tuple] = field(
        default_factory=dict
    )  # functional linear -> (weight, bias) names
    fp32: set[str] = field(
        default_factory=set
    )  # sites run by this plan's FP32 islands (patch/_reach.py)
    pinned: set[str] = field(default_factory=set)  # sites whose class can carry no scale
    tied: list[tuple[str, ...]] = field(default_factory=list)  # sites that must share one class
    fxnodes: dict[str, str] = field(
        default_factory=dict
    )  # the model's own functional sites -> fx nodes
    fxgroup: Callable[..., bool] | None = (
        None  # names -> whether those fx nodes can run as one island (_fxisland.py)
    )

    def find(self, site: str) -> str:
        return self._find(site)[0]

    def weight(self, site: str) -> Fraction:
        """The exponent of ``site``'s scale: its class's p raised to it (1 at the root)."""
        return self._find(site)[1]

    def scale(self, site: str | None, scales: dict[str, float]) -> float:
        """The scale ``site``'s output carries under ``scales`` (class root -> p)."""
        if site is None:
            return 1.0
        root, w = self._find(site)
        return float(scales.get(root, 1.0) ** w)

    def _find(self, site: str) -> tuple[str, Fraction]:
        path, node = [], site
        while self.parent.get(node, node) != node:
            path.append(node)
            node = self.parent[node]
        w = Fraction(1)
        for n in reversed(path):  # path compression, exponents multiplied down the path
            w *= self.rel.get(n, Fraction(1))
            self.parent[n], self.rel[n] = node, w
        return node, self.rel.get(site, Fraction(1)) if site != node else Fraction(1)

    def union(self, a: str, b: str, k: Fraction = Fraction(1)) -> None:
        """Join the classes so that ``b``'s exponent is ``k`` times ``a``'s."""
        (ra, wa), (rb, wb) = self._find(a), self._find(b)
        if ra != rb:
            self.parent[rb], self.rel[rb] = ra, k * wa / wb
        elif wb != k * wa:
            self.conflicts.add(ra)

    def is_module(self, site: str) -> bool:
        """A module site (an FP32 island can wrap it), not a functional conv/linear."""
        return isinstance(self.modules.get(site), nn.Module)

    def members(self, root: str) -> list[str]:
        """Sites of one class, in the report's execution order."""
        return [s for s in self.kinds if self.find(s) == root]

    def input_site(self, site: str) -> str | None:
        """A producer of ``site`` (its producers share one scale), None for model inputs."""
        prods = self.producers.get(site, [])
        return prods[0] if prods else None

    def input_class(self, site: str) -> str | None:
        """The class of a site's input (its producers share one class), None for model inputs."""
        prods = self.producers.get(site, [])
        return self.find(prods[0]) if prods else None

    def snapshot(self) -> tuple:
        """The kinds, modules and products as built, before a plan marks its islands."""
        return dict(self.kinds), dict(self.modules), dict(self.carries)

    def restore(self, saved: tuple) -> None:
        """Back to ``snapshot``'s state, without cuts, islands or pins."""
        kinds, modules, carries = saved
        self.kinds, self.modules, self.carries = dict(kinds), dict(modules), dict(carries)
        self.fp32, self.pinned, self.tied = set(), set(), []
        self.recut(set())

    def recut(self, cuts: set[tuple[str, str]]) -> None:
        """Recompute the classes with the join operands in ``cuts`` left out (each gets a
        scalar multiply instead of sharing the join's scale)."""
        self.cuts = set(cuts)
        self.parent, self.rel, self.conflicts = {}, {}, set()
        _unite(self)


def build_graph(model: nn.Module, report: Report, binding: Binding | None = None) -> SiteGraph:
    """Site graph of ``report`` bound to ``model``'s modules (or to ``binding``: how another
    kind of model, an ONNX graph, gives each site its kind); PatchError when they do not match."""
    binding = binding or TorchBinding(model)
    producers: dict[str, list[str]] = {s: [] for s in report.sites}
    consumers: dict[str, list[str]] = {s: [] for s in report.sites}
    for p, c in report.edges:
        if p == c:
            continue
        _check_known(report, p, c)
        if p not in producers[c]:
            producers[c].append(p)
            consumers[p].append(c)
    kinds, modules = {}, {}
    for name, st in report.sites.items():
        kinds[name], mod = binding.site(name, st, len(producers[name]))
        if mod is not None:
            modules[name] = mod
    carries = {
        s: carrier
        for s, st in report.sites.items()
        if binding.is_product(st) and (carrier := product_carrier(s, producers)) is not None
    }
    modules = {s: m for s, m in modules.items() if s not in carries}  # a product's x passes
    kinds.update(dict.fromkeys(carries, Kind.HOMOG))  # the scale of x passes; g must be unscaled
    params, hosts = {}, {}
    if model is not None:  # a PyTorch model: parameters reached by probes and torch.fx
        hosts = _hosted_linears(model, report, producers, consumers, kinds)
        for site, (w, b) in hosts.items():  # a functional linear on parameters patch can reach
            kinds[site], modules[site] = (
                Kind.LINEAR,
                FunctionalParams(model.get_parameter(w), b and model.get_parameter(b)),
            )
        for name in _tied(model, modules):  # rescaling one would rescale the other's parameters
            kinds[name] = Kind.OPAQUE
        params = _param_joins(model, report, producers)
        kinds.update(
            dict.fromkeys(_constant_products(model, report, producers, carries), Kind.HOMOG)
        )
        kinds.update(
            dict.fromkeys(params, Kind.JOIN)
        )  # x + parameter: the parameter takes x's scale
    graph = SiteGraph(
        producers,
        consumers,
        kinds,
        modules,
        frozen=binding.frozen(report),
        owners=binding.owners,
        carries=carries,
        params=params,
        hosts=hosts,
        ops={n: st.op for n, st in report.sites.items() if st.kind != "module"},
    )
    _unite(graph)
    return graph


class Binding(Protocol):
    """How the planner reads a model: ``TorchBinding`` a PyTorch module, ``OnnxBinding``
    (``patch/onnx/_binding.py``) an ONNX graph. Another model format is another binding,
    not another planner."""

    @property
    def owners(self) -> Collection[str]:
        """Modules that host functional ops ("" never): fallback islands."""

    @property
    def mappable(self) -> Callable | None:
        """Whether a join's operand can take a multiply (None: map onto torch.fx)."""

    def contract(self, report: Report) -> Report:
        """The report with units the planner treats as one site merged (fused norms)."""

    def site(self, name: str, st, n_producers: int) -> tuple[str, Any]:
        """The site's ``Kind`` and the object holding its parameters (a module, a node)."""

    def frozen(self, report: Report) -> set[str]:
        """Sites inside FP32 islands of an earlier patch (left as they are)."""

    def is_product(self, st) -> bool:
        """Whether the site is a product x * g(x) that may carry x's scale."""


class TorchBinding:
    """How the planner reads a PyTorch model: each site's kind and module, the sites inside
    FP32 islands, the modules that host functional ops (``OnnxBinding`` reads a graph)."""

    mappable = None  # a join's operands are mapped onto torch.fx nodes (patch/_cuts.py)

    def __init__(self, model: nn.Module):
        self.model, self.named = model, dict(model.named_modules())
        self.owners = {n for n in self.named if n}

    def contract(self, report: Report) -> Report:
        return contract(self.model, report)  # fused norm modules: one site each

    def site(self, name: str, st, n_producers: int) -> tuple[str, nn.Module | None]:
        kind, mod = _kind(self.named, name, st, n_producers)
        params = functional_params(self.model, name) if st.kind != "module" else None
        if params is not None:  # a GraphModule's functional conv/linear absorbs like a module
            kind, mod = Kind.LINEAR, params
        return kind, mod

    def frozen(self, report: Report) -> set[str]:
        return _in_islands(self.named, report)

    @staticmethod
    def is_product(st) -> bool:
        return st.kind != "module" and is_product(st.op)


def _hosted_linears(
    model: nn.Module, report: Report, producers: dict, consumers: dict, kinds: dict
) -> dict:
    """Functional linears whose parameters patch can find: the one whose value its module
    returns (``F.linear(x, self.proj.weight, self.proj.bias)``: Swin's attention), or the
    one that first reads its module's input (``nn.MultiheadAttention``'s ``in_proj``),
    mapped to the qualified names of their weight and bias (or None); found by running the
    module on a random input of its one input's shape (``output_linear_child``,
    ``input_linear_weight``)."""
    found: dict[str, tuple[str | None, ...]] = {}  # site -> (weight, bias) names
    by_module: dict[str, set[str]] = {}
    for s, o in report.sites.items():
        if o.kind != "module":
            by_module.setdefault(o.module, set()).add(s)
    for site, st in report.sites.items():
        if (
            st.kind == "module"
            or kinds[site] != Kind.OPAQUE
            or aten_class(st.op) != OpClass.ABSORBING
            or not st.module
        ):
            continue
        own = by_module[st.module]
        leaving = [s for s in own if any(c not in own for c in consumers[s])]
        entering = [s for s in own if any(p not in own for p in producers[s])]
        inputs = {p for s in own for p in producers[s] if p not in own}
        shape = report.sites[next(iter(inputs))].shape if len(inputs) == 1 else None
        probe = (
            output_linear_child
            if leaving == [site]
            else input_linear_weight
            if entering == [site]
            else None
        )
        if probe is None or not shape:
            continue
        names = probe(
            model.get_submodule(st.module),
            torch.randn(shape, generator=torch.Generator().manual_seed(0)),
        )
        if (
            names is not None and names[0].rpartition(".")[0] not in report.sites
        ):  # not a module site
            found[site] = tuple(None if n is None else f"{st.module}.{n}" for n in names)
    return found


def _tied(model: nn.Module, modules: dict) -> list[str]:
    """Module sites holding a parameter that another module site holds too (an embedding
    tied to an output projection): neither can take a scale of its own. A holder that
    never runs (T5's ``shared`` beside ``encoder.embed_tokens``) does not count."""
    holders: dict[int, set[int]] = {}  # parameter -> the modules holding it
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(mod))
    ran = {id(m): s for s, m in modules.items() if isinstance(m, nn.Module)}  # module sites
    shared = {
        ran[m]
        for mods in holders.values()
        if sum(m in ran for m in mods) > 1
        for m in mods
        if m in ran
    }
    return sorted(shared)


def _constant_products(
    model: nn.Module, report: Report, producers: dict, carries: dict
) -> list[str]:
    """Products of one tensor with a constant (a layer scale, a number): x's scale passes."""
    found: list[str] = []
    graphs: dict = {}  # constant_factor's cache of traced graphs
    ops = Counter((st.module, st.op) for st in report.sites.values() if st.kind != "module")
    for name, st in report.sites.items():
        if (
            st.kind != "module"
            and is_product(st.op)
            and name not in carries
            and len(producers[name]) == 1
            and constant_factor(model, name, ops[st.module, st.op], graphs)
        ):
            found.append(name)
    return found


def _param_joins(model: nn.Module, report: Report, producers: dict) -> dict[str, tuple[str, ...]]:
    """Joins of tensors with parameters (a class token, a position embedding): each
    parameter, scaled by 1/p in place, carries the scale of the join's tensor operands;
    joins of one tensor with itself (a patch merging's slices) carry its scale as they are."""
    found: dict[str, tuple[str, ...]] = {}
    graphs: dict = {}  # constant_factor's cache of traced graphs
    ops = Counter((st.module, st.op) for st in report.sites.values() if st.kind != "module")
    for name, st in report.sites.items():
        if st.kind != "module" and is_join(st.op) and len(producers[name]) == 1:
            params = parameter_operands(model, name, 1, ops[st.module, st.op], graphs)
            if params is not None:
                found[name] = params
    return found


def _in_islands(named: dict, report: Report) -> set[str]:
    """Sites that run inside an FP32 island (their values may exceed FP16 by design)."""
    prefixes = [n for n, m in named.items() if is_island(m)]

    def inside(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return {s for s, st in report.sites.items() if inside(s if st.kind == "module" else st.module)}


def _check_known(report: Report, *sites: str) -> None:
    for s in sites:
        if s not in report.sites:
            raise PatchError(
                f"the report's dataflow names site {s!r}, which the report does not describe; "
                "the report is damaged: re-create it with fp16lens.watch(model)"
            )


def _kind(named: dict, name: str, st, n_producers: int) -> tuple[str, nn.Module | None]:
    if st.kind == "module":
        mod = named.get(name)
        if mod is None or type(mod).__name__ != st.op:
            found = "absent" if mod is None else f"a {type(mod).__name__}"
            raise PatchError(
                f"the report names module {name!r} ({st.op}) but in this model it is {found}; "
                "the report is from another model: watch this model and patch with its report"
            )
        return module_kind(mod), mod
    if st.module not in named:
        raise PatchError(
            f"the report's site {name!r} runs in module {st.module!r}, which this model lacks; "
            "the report is from another model: watch this model and patch with its report"
        )
    return op_kind(st.op, n_producers), None


def _unite(graph: SiteGraph) -> None:
    for group in graph.tied:  # the inputs of one FP32 island of several sites: one in_scale
        for s in group[1:]:
            graph.union(group[0], s)
    for site, kind in graph.kinds.items():
        prods = graph.producers[site]
        if site in graph.carries:
            graph.union(site, graph.carries[site])
        elif kind in (Kind.HOMOG, Kind.JOIN, Kind.POWER):
            k = 1 / degree(graph.ops.get(site, "")) if kind == Kind.POWER else Fraction(1)
            for p in prods:
                if (p, site) not in graph.cuts:
                    graph.union(site, p, k)
        elif site in graph.modules:  # one module, one set of parameters: one input scale
            for p in prods[1:]:
                graph.union(prods[0], p)
