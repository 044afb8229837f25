"""What the ONNX stages read alike from a graph: its tensors' element types, and the
control-flow bodies (If branches, Loop and Scan bodies) of its nodes with the outer values
they read. The scan, the ONNX patch and the FP16 export use these."""

from __future__ import annotations


def elem_types(proto, onnx) -> dict[str, int]:
    """Tensor name -> ONNX element type, from shape inference where it runs, else from the
    declared types (custom ops); ``onnx``: the imported module (an optional dependency)."""
    try:
        g = onnx.shape_inference.infer_shapes(proto).graph
    except Exception:  # unknown custom ops: declared types only
        g = proto.graph
    elem = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        if vi.type.HasField("tensor_type"):
            elem[vi.name] = vi.type.tensor_type.elem_type
    return elem


def subgraphs(node):
    """The bodies a node holds (If branches, a Loop or Scan body), in attribute order."""
    for a in node.attribute:
        if a.type == a.GRAPH:
            yield a.g
        elif a.type == a.GRAPHS:
            yield from a.graphs


def has_subgraph(node) -> bool:
    """Whether ``node`` holds a control-flow body."""
    return any(a.type in (a.GRAPH, a.GRAPHS) for a in node.attribute)


def outer_names(graph) -> set[str]:
    """Tensors a (sub)graph reads from its enclosing scopes, nested bodies included: as node
    inputs, or returned as they are (a branch whose output is an outer value)."""
    defined = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    defined |= {o for n in graph.node for o in n.output}
    used = {t for n in graph.node for t in n.input if t} | {o.name for o in graph.output}
    used |= {t for n in graph.node for g in subgraphs(n) for t in outer_names(g)}
    return used - defined


def rename_reads(graph, names: dict[str, str]) -> None:
    """Every read of an outer value ``t`` in ``graph`` and its nested bodies (where no inner
    value shadows it), node inputs and returned outputs, reads ``names[t]`` instead."""
    inner = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    inner |= {o for n in graph.node for o in n.output}
    names = {t: new for t, new in names.items() if t not in inner}
    if not names:
        return
    for n in graph.node:
        n.input[:] = [names.get(t, t) for t in n.input]
        for g in subgraphs(n):
            rename_reads(g, names)
    for o in graph.output:
        o.name = names.get(o.name, o.name)
