"""Functional activations (``F.silu(x)``, ``torch.sigmoid(x)``, ``x.tanh()`` in a module's
forward) as FP32 islands of their own.

No scale passes such a call and no module wraps it, so without this its whole owner
would run in FP32. Where the owner traces with torch.fx and the call is found there, the
planner treats the site as a blocking module (a scaled island: fed ``x * in_scale`` in
FP32, its output ``/ out_scale`` handed back in the model's dtype) and ``apply_plan``
turns the call into a call of a new child of the owner, ``Fp32Island(Activation(...))``.
The owner becomes a GraphModule (as for a Multiply); the new child has no parameters, so
state_dict keys do not change.
"""

from __future__ import annotations

import dataclasses

from torch import fx, nn

from fp16lens._core import PatchError
from fp16lens._core.algebra import Kind
from fp16lens._core.sites import parse_site
from fp16lens.patch._fx_read import _RETRACED, trace_owner
from fp16lens.patch._island import Fp32Island
from fp16lens.patch._plan import Island

ACTIVATIONS = frozenset({
    "silu", "gelu", "hardswish", "hardsigmoid", "sigmoid", "tanh", "mish", "elu", "selu",
    "celu", "softplus",
})  # fmt: skip
"""Elementwise activations of one tensor whose aten name (what watch calls the site) is
the name of the torch function or tensor method that runs them."""


class Activation(nn.Module):
    """One functional activation as a module: ``fn(x, *args, **kwargs)``, or
    ``x.<fn>(*args, **kwargs)`` for a tensor method; no parameters and no buffers."""

    def __init__(self, fn, args: tuple = (), kwargs: dict | None = None):
        super().__init__()
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs or {})

    def forward(self, x):
        if isinstance(self.fn, str):
            return getattr(x, self.fn)(*self.args, **self.kwargs)
        return self.fn(x, *self.args, **self.kwargs)

    def extra_repr(self) -> str:
        return _fn_name(self.fn)


def _fn_name(fn) -> str:
    """``F.silu``, ``"sigmoid"`` (a tensor method), ``aten.tanh.default`` -> the op's name."""
    fn = getattr(fn, "overloadpacket", fn)  # an aten op of a torch.export graph
    return (fn if isinstance(fn, str) else getattr(fn, "__name__", "")).lower().removesuffix("_")


def _node_op(node: fx.Node) -> str | None:
    if node.op == "call_function" or node.op == "call_method":
        return _fn_name(node.target)
    return None


def _single_input(node: fx.Node) -> bool:
    """The call's first argument is its only fx value (the rest are constants)."""
    rest = [*node.args[1:], *node.kwargs.values()]
    return (
        bool(node.args)
        and isinstance(node.args[0], fx.Node)
        and not any(isinstance(a, fx.Node) for a in rest)
    )


def find_activation(gm: fx.GraphModule, site: str) -> fx.Node | None:
    """The fx node of functional activation ``site``: by node name in a GraphModule watch
    named, else the n-th call of that activation in the traced forward; None if absent."""
    name = parse_site(site)
    if not getattr(gm, _RETRACED, False):
        node = next((n for n in gm.graph.nodes if n.name == name.op), None)
        return (
            node
            if node is not None and _node_op(node) in ACTIVATIONS and _single_input(node)
            else None
        )
    nodes = [n for n in gm.graph.nodes if _node_op(n) == name.op]
    node = nodes[name.nth - 1] if 0 < name.nth <= len(nodes) else None
    return node if node is not None and _single_input(node) else None


def mark_activations(model: nn.Module, graph, report) -> dict[str, str]:
    """Make each functional activation on or next to a span a blocking module site of
    ``graph``; returns site -> the qualified name its island will have in the patched
    model. A module that runs nothing but the activation (HF's ``GELUActivation``) is the
    island itself; elsewhere the island is a new child (its module the ``Activation`` it
    becomes), unless another op of the same forward no scale passes would make the owner an
    island anyway."""
    spans = {s for sp in report.spans for s in sp.sites}
    near = spans | {c for s in spans for c in graph.consumers.get(s, ())}
    traced: dict[str, fx.GraphModule | None] = {}
    found: dict[str, str] = {}
    taken: set[str] = set()
    for site in sorted(near, key=lambda s: report.sites[s].order if s in report.sites else 0):
        st = report.sites.get(site)
        if (
            st is None
            or st.kind == "module"
            or site in graph.frozen
            or len(graph.producers.get(site, ())) != 1
        ):
            continue
        if _fn_name(st.op) not in ACTIVATIONS:
            continue
        if _alone(model, report, st.module):
            graph.kinds[site], graph.modules[site], found[site] = (
                Kind.BLOCK,
                model.get_submodule(st.module),
                st.module,
            )
            continue
        gm = _traced(model, st.module, traced)
        node = (
            None if gm is None or not _numbered_alike(gm, report, st) else find_activation(gm, site)
        )
        if node is None or _opaque_beside(graph, report, site, near):
            continue
        graph.kinds[site] = Kind.BLOCK
        graph.modules[site] = Activation(node.target, node.args[1:], node.kwargs)
        found[site] = _child_name(model, st.module, site, taken)
    return found


def _alone(model: nn.Module, report, owner: str) -> bool:
    """The owner (not the model itself) has no parameters, buffers or children and runs
    one op: an island around it is the activation alone."""
    if not owner:
        return False
    mod = model.get_submodule(owner)
    if next(mod.children(), None) is not None or next(mod.parameters(), None) is not None:
        return False
    return (
        next(mod.buffers(), None) is None
        and sum(s.module == owner for s in report.sites.values()) == 1
    )


def _opaque_beside(graph, report, site: str, near: set[str]) -> bool:
    """Another op of the same forward on or next to a span that no scale passes (its
    owner becomes an island: a child island inside it would be traced twice)."""
    owner = report.sites[site].module
    return any(
        s != site
        and report.sites[s].kind != "module"
        and report.sites[s].module == owner
        and graph.kinds.get(s) == Kind.OPAQUE
        and _fn_name(report.sites[s].op) not in ACTIVATIONS
        for s in near
        if s in report.sites
    )


def _traced(model: nn.Module, owner: str, traced: dict) -> fx.GraphModule | None:
    if owner not in traced:
        try:
            traced[owner] = trace_owner(model, owner)
        except PatchError:
            traced[owner] = None
    return traced[owner]


def _numbered_alike(gm: fx.GraphModule, report, st) -> bool:
    """The traced forward calls the activation as often as watch numbered it (the n-th fx
    call is the n-th site), or the GraphModule's node names are watch's."""
    if not getattr(gm, _RETRACED, False):
        return True
    key = _fn_name(st.op)
    sites = [
        s
        for s in report.sites.values()
        if s.kind != "module" and s.module == st.module and _fn_name(s.op) == key
    ]
    return len(sites) == sum(_node_op(n) == key for n in gm.graph.nodes)


def _child_name(model: nn.Module, owner: str, site: str, taken: set[str]) -> str:
    """A free attribute of the owner for the island: ``silu_fp32``, ``silu_2_fp32``."""
    name = parse_site(site)
    mod = model.get_submodule(owner) if owner else model
    base = f"{name.op}_{name.nth}_fp32" if name.nth > 1 else f"{name.op}_fp32"
    attr, k = base, 1
    while hasattr(mod, attr) or f"{owner}.{attr}" in taken:
        k += 1
        attr = f"{base}{k}"
    qualified = f"{owner}.{attr}" if owner else attr
    taken.add(qualified)
    return qualified


def rename_islands(islands: list[Island], found: dict[str, str]) -> list[Island]:
    """Islands planned on functional sites, named by the module each becomes (a new child,
    or the owner that runs the activation alone, then an island of the usual kind)."""
    out = []
    for i in islands:
        name = found.get(i.module)
        if name is None:
            out.append(i)
            continue
        whole = parse_site(i.module).module == name
        why = i.reason
        if why.endswith(
            "does not commute with scaling"
        ):  # module_changes names the Activation class
            how = (
                f"its module {name} runs nothing else"
                if whole
                else f"it becomes the new child {name}"
            )
            why = f"{i.module} ({parse_site(i.module).op}) does not commute with scaling; {how}"
        out.append(dataclasses.replace(i, module=name, reason=why, site="" if whole else i.module))
    return out


def insert_island(gm: fx.GraphModule, island: Island) -> None:
    """Replace the call of ``island.site`` in ``gm`` by a call of a new child, an FP32
    island around the activation, named by the last part of ``island.module``."""
    node = find_activation(gm, island.site)
    if node is None:
        raise PatchError(f"cannot find {island.site} in the traced forward of its module")
    attr = island.module.rpartition(".")[2]
    act = Activation(node.target, node.args[1:], node.kwargs)
    gm.add_submodule(
        attr, Fp32Island(act, island.in_scale, island.out_scale, island.fp32_out, island.fp32_in)
    )
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(attr, (node.args[0],))
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
