"""One If replaced by the nodes of one of its branches, in a copy of the graph the scan
runs (ONNX Runtime exposes no tensor computed in a subgraph; ``_paths.py`` decides which
branch each batch takes).

An inlined node's site is ``<If site>/<then|else>/<node site>`` (``If_0/then//stft/Conv``,
``_core/sites.branch_site``): the If that holds it, the branch and its name inside. The
branch's outputs take the If's output names; a branch value whose name the outer graph
already uses is renamed with the same prefix.
"""

from __future__ import annotations

from fp16lens._core.onnx_types import subgraphs
from fp16lens._core.sites import IF_BRANCHES, branch_site
from fp16lens.watch.onnx._graph import onnx_module


def node_site(node) -> str:
    return node.name or node.output[0]


def _names(graph, skip=None) -> set[str]:
    """Every value name of ``graph`` and its subgraphs (``skip``: a node left out)."""
    out = {v.name for v in (*graph.input, *graph.initializer, *graph.output)}
    for node in graph.node:
        if node is skip:
            continue
        out.update(node.input)
        out.update(node.output)
        for g in subgraphs(node):
            out |= _names(g)
    return out


def _rename(graph, names: dict[str, str]) -> None:
    """Rename values in ``graph``'s nodes, recursively through nested subgraphs."""
    for node in graph.node:
        node.input[:] = [names.get(t, t) for t in node.input]
        node.output[:] = [names.get(t, t) for t in node.output]
        for g in subgraphs(node):
            _rename(g, names)
    for v in (*graph.output, *graph.value_info):
        v.name = names.get(v.name, v.name)


def _attr_graph(node, name: str):
    return next(a.g for a in node.attribute if a.name == name)


def inline_if(model, index: int, cond: bool) -> str:
    """Replace the If at ``model.graph.node[index]`` by its taken branch, in place; returns
    the prefix of the inlined nodes' names."""
    onnx = onnx_module()
    g = model.graph
    node = g.node[index]
    prefix = branch_site(node_site(node), cond, "")
    branch = onnx.GraphProto()
    branch.CopyFrom(_attr_graph(node, f"{IF_BRANCHES[cond]}_branch"))
    outer = _names(g, skip=node)
    local = {t for n in branch.node for t in n.output if t} | {i.name for i in branch.initializer}
    names = {t: prefix + t for t in local if t in outer}
    identities, claimed = [], set()
    for k, out in enumerate(branch.output):
        target = node.output[k] if k < len(node.output) else ""
        if not target:
            continue
        if out.name in local and out.name not in claimed:  # the branch's node now writes it
            names[out.name] = target
            claimed.add(out.name)
        else:  # an outer value, or one value given twice
            identities.append(
                onnx.helper.make_node(
                    "Identity",
                    [names.get(out.name, out.name)],
                    [target],
                    name=f"{prefix}output_{k}",
                )
            )
    _rename(branch, names)
    for n in branch.node:
        n.name = prefix + node_site(n)
    for init in branch.initializer:
        init.name = names.get(init.name, init.name)
    g.initializer.extend(branch.initializer)
    g.value_info.extend(v for v in branch.value_info if v.name not in names.values())
    new = [*branch.node, *identities]
    del g.node[index]
    for i, n in enumerate(new):
        g.node.insert(index + i, n)
    return prefix
