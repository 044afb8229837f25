"""What the ONNX stages read alike from a graph: its tensors' element types, and the
control-flow bodies (If branches, Loop and Scan bodies) of its nodes with the outer values
they read; and whether a model is an ONNX graph at all (``is_onnx``). The scan, the ONNX
patch, the FP16 export, verify and the CLI use these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp16lens._core import onnx_large

PRECISION_KEY = "fp16lens.precision"
"""The ``metadata_props`` key of the precision fp16lens.export wrote a file in (fp32, fp16, int8)."""
FP32_NODES_KEY = "fp16lens.fp32_nodes"
"""The ``metadata_props`` key naming, as a JSON list, the nodes an FP16 export keeps in FP32
(a patched graph's islands; an FP16 file's own FP32 nodes in its FP32 twin)."""


def is_onnx(model: Any) -> bool:
    """A path ending in .onnx (any case), or an ``onnx.ModelProto``: the one test of every
    stage and the CLI for "is this an ONNX graph?" (onnx itself is not imported)."""
    if isinstance(model, (str, Path)):
        return Path(model).suffix.lower() == ".onnx"
    return type(model).__name__ == "ModelProto" and hasattr(model, "graph")


def read_file(onnx, path: Path, error: type[Exception], missing: str = "check the path"):
    """The ModelProto of the ONNX file ``path``, its external data read in; a missing file,
    a file that is not ONNX or a missing data file raise ``error`` in one line."""
    if not path.is_file():
        raise error(f"ONNX model {path} does not exist; {missing}")
    try:
        return onnx.load(str(path), load_external_data=True)
    except Exception as exc:  # protobuf decode errors, missing external data files
        raise error(
            f"cannot read {path} as ONNX ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "check that it is an .onnx file and that its external data files lie beside it"
        ) from exc


def check_graph(onnx, proto, source: Any = None) -> None:
    """``onnx.checker``'s full check (shape inference included) of ``proto``, made from the
    ONNX graph ``source`` (a path or ModelProto; None: from PyTorch). Where ``source`` fails
    the full check itself (shapes inside Loop/If bodies that contradict what inference
    finds, as Paddle2ONNX writes them; ONNX Runtime runs such files), ``proto`` is held to
    the basic check the source passes, and where the source fails that too (a graph output
    declared with a type and no shape) to nothing: a flaw of the source is not ours to
    refuse, and the written file is checked by running it."""
    try:
        onnx_large.check(onnx, proto, full_check=True)
        return
    except Exception:
        if source is None or _passes(onnx, source, full_check=True):
            raise
    try:
        onnx_large.check(onnx, proto)
    except Exception:
        if _passes(onnx, source, full_check=False):
            raise


def _passes(onnx, source, full_check: bool) -> bool:
    """Whether the ONNX graph ``source`` (a path or ModelProto) passes the checker."""
    try:
        if isinstance(source, (str, Path)):
            onnx.checker.check_model(str(source), full_check=full_check)
        else:
            onnx_large.check(onnx, source, full_check=full_check)
    except Exception:
        return False
    return True


def elem_types(proto, onnx) -> dict[str, int]:
    """Tensor name -> ONNX element type, from shape inference where it runs, else from the
    declared types (custom ops); ``onnx``: the imported module (an optional dependency)."""
    try:
        g = onnx_large.infer_shapes(onnx, proto).graph
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


def ancestors(graph, tensors, *, through_bodies: bool = False) -> set[int] | None:
    """Indices of the nodes of ``graph`` that ``tensors`` depend on (the nodes making them
    included). A node that holds a body (If, Loop, Scan) gives None, or with
    ``through_bodies`` is walked through by its inputs alone (what its body reads from
    outside is not followed)."""
    producers = {t: i for i, n in enumerate(graph.node) for t in n.output if t}
    seen: set[int] = set()
    todo = list(tensors)
    while todo:
        i = producers.get(todo.pop())
        if i is None or i in seen:
            continue
        if not through_bodies and has_subgraph(graph.node[i]):
            return None
        seen.add(i)
        todo.extend(t for t in graph.node[i].input if t)
    return seen


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


def _reads(node) -> list[str]:
    """What ``node`` reads: its inputs, and the outer values its bodies read."""
    return [t for t in node.input if t] + [t for g in subgraphs(node) for t in outer_names(g)]


def _needs(nodes) -> list[set[int]]:
    """Per node, the indices of the other nodes that write what it reads."""
    writer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    return [{writer[t] for t in _reads(n) if t in writer} - {i} for i, n in enumerate(nodes)]


def _in_order(graph) -> bool:
    """Whether every node of ``graph`` (and of each body) comes after the nodes it reads."""
    needs = _needs(graph.node)
    if any(j > i for i, deps in enumerate(needs) for j in deps):
        return False
    return all(_in_order(g) for n in graph.node for g in subgraphs(n))


def _sort_nodes(graph) -> None:
    """Order ``graph``'s nodes (and each body's) topologically, keeping the file's order
    wherever it already holds. A graph with a cycle (not a valid graph) is left as it is."""
    import heapq

    for n in graph.node:
        for g in subgraphs(n):
            _sort_nodes(g)
    nodes = list(graph.node)
    needs = _needs(nodes)
    readers: list[list[int]] = [[] for _ in nodes]
    for i, deps in enumerate(needs):
        for j in deps:
            readers[j].append(i)
    waiting = [len(deps) for deps in needs]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers[i]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) == len(nodes):  # else a cycle: not ours to repair
        kept = [type(nodes[i])() for i in order]
        for node, i in zip(kept, order):
            node.CopyFrom(nodes[i])
        del graph.node[:]
        graph.node.extend(kept)


def in_order(proto) -> Any:
    """``proto`` itself where its nodes are topologically sorted, as ``onnx.checker`` wants
    them, else a sorted copy. ONNX Runtime runs a file whose nodes are out of order (an
    input Cast that onnxconverter-common's ``keep_io_types`` appended after its readers, as
    in the FP16 ISNet that @imgly/background-removal ships); the scan's spans follow graph
    order, and the files patch and export write must pass the checker."""
    if _in_order(proto.graph):
        return proto
    copy = type(proto)()
    copy.CopyFrom(proto)
    _sort_nodes(copy.graph)
    return copy
