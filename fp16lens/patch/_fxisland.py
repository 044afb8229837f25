"""Functional ops of the model's own forward as one FP32 island (``x * F.relu6(x + 3) / 6``
written in ``forward``): no module runs them but the model itself, so they become a new
child, a GraphModule of their fx nodes inside an ``Fp32Island``, called where they ran.

Sites are mapped to fx nodes by running ``watch`` once on the traced forward (its sites are
named by fx node) with random inputs of the report's shapes: the model's own functional
sites, in execution order, against the report's. A group runs as one island when its
nodes are functional (no module call, no attribute read), read one tensor from outside
and hand one tensor on; otherwise its ops stay unresolved.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from fp16lens._core import PatchError
from fp16lens._core.sites import parse_site
from fp16lens._trace import graph_forwards, running_node
from fp16lens.patch._fx_read import _RETRACED, trace_owner
from fp16lens.patch._island import Fp32Island
from fp16lens.patch._trace import SiteTracer, Trace, traced


class Ops(nn.Module):
    """The ops of one FP32 island of the model's own forward: a GraphModule of their fx
    nodes, held outside the module tree (no parameters: nothing to register)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.graph_module = (gm,)

    def forward(self, x):
        return self.graph_module[0](x)

    def extra_repr(self) -> str:
        return ", ".join(
            n.name
            for n in self.graph_module[0].graph.nodes
            if n.op not in ("placeholder", "output")
        )


def root_nodes(model: nn.Module, report) -> dict[str, str]:
    """The model's own functional sites -> the names of their fx nodes (empty when the
    forward does not trace, or its ops do not line up with the report's)."""
    own = sorted(
        (s for s, st in report.sites.items() if st.kind != "module" and st.module == ""),
        key=lambda s: report.sites[s].order,
    )
    if not own or not report.meta.input_shapes:
        return {}
    try:
        gm = trace_owner(model, "")
    except PatchError:
        return {}
    if not getattr(gm, _RETRACED, False):  # a GraphModule watch named: sites are node names
        names = {n.name for n in gm.graph.nodes}
        return {s: parse_site(s).op for s in own if parse_site(s).op in names}
    g = torch.Generator().manual_seed(0)  # a patch-time probe of the traced forward
    inputs = [torch.rand(shape, generator=g) for shape in report.meta.input_shapes[0]]
    probe = _NodeOrder(graph_forwards({gm: ""}).get(""))
    try:
        with torch.no_grad(), traced(gm, SiteTracer(probe)):
            gm(*inputs)
    except Exception:  # inputs that are not random floats (token ids): no mapping
        return {}
    if probe.forward is None or [report.sites[s].op for s in own] != [op for op, _ in probe.seen]:
        return {}
    if any(node is None for _, node in probe.seen):
        return {}
    return {a: node for a, (_, node) in zip(own, probe.seen)}


class _NodeOrder(Trace):
    """The root's functional op sites of a GraphModule's forward in order: (op, fx node
    running it), named as watch names them (``fp16lens._trace``'s op rules)."""

    def __init__(self, forward):
        super().__init__(keep=False, find_nonfinite=False)
        self.forward, self.seen = forward, []

    def add(self, site: str, tensor) -> None:
        parsed = parse_site(site)
        if ":" in site and parsed.module == "" and self.forward is not None:
            self.seen.append((parsed.op.split("#")[0], running_node(self.forward)))


def group_io(gm: fx.GraphModule, names: set[str]) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(the one node the group reads from outside, its one output node, its nodes in order),
    or None when the group is not such a single-input, single-output functional piece."""
    nodes = [n for n in gm.graph.nodes if n.name in names]
    if len(nodes) != len(names) or any(n.op not in ("call_function", "call_method") for n in nodes):
        return None
    inside = set(nodes)
    reads = {a for n in nodes for a in n.all_input_nodes if a not in inside}
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(reads) != 1 or len(outs) != 1 or next(iter(reads)).op == "get_attr":
        return None
    return next(iter(reads)), outs[0], nodes


def groupable(model: nn.Module, traced: dict, names: set[str]) -> bool:
    """Whether the fx nodes ``names`` of the model's forward can run as one island
    (``traced`` caches the traced forward)."""
    if "" not in traced:
        try:
            traced[""] = trace_owner(model, "")
        except PatchError:
            traced[""] = None
    return traced[""] is not None and group_io(traced[""], names) is not None


def insert_group(gm: fx.GraphModule, attr: str, names: tuple[str, ...], island) -> None:
    """Move the nodes ``names`` into a new child ``attr``: ``Fp32Island(GraphModule)``
    with the island's scales and hand-offs, called on the group's one input."""
    found = group_io(gm, set(names))
    if found is None:
        raise PatchError(
            f"cannot move {', '.join(names)} of the model's forward into an FP32 island"
        )
    source, out, nodes = found
    sub = fx.Graph()
    env = {source: sub.placeholder("x")}
    for n in nodes:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[out])
    child = Ops(fx.GraphModule(nn.Module(), sub, class_name="Fp32Ops"))
    gm.add_submodule(
        attr, Fp32Island(child, island.in_scale, island.out_scale, island.fp32_out, island.fp32_in)
    )
    with gm.graph.inserting_after(out):
        call = gm.graph.call_module(attr, (source,))
    out.replace_all_uses_with(call)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
