"""Whether a scale class can carry a scale: its entries absorb 1/p, its exits absorb p."""

from __future__ import annotations

from fp16lens._core.algebra import ABSORB_IN, ABSORB_OUT, PASSES, Kind, norm_has_affine
from fp16lens.patch._graph import SiteGraph


def class_problem(graph: SiteGraph, root: str) -> str | None:
    """Why the class cannot carry a scale, or None when it can."""
    if root in graph.conflicts:
        return f"{root}'s class meets one tensor at two powers of the scale (a join of x and x**2)"
    for m in graph.members(root):
        kind = graph.kinds[m]
        if m in graph.pinned:
            return f"{m} is an FP32 island's input or output that carries no scale"
        if kind in PASSES and not graph.producers[m]:
            return f"{m} takes a model input, which carries no scale"
        if kind not in PASSES and not _absorbs_out(graph, m):
            return f"{m} ({kind}) cannot take 1/p in its parameters"
        if not graph.consumers[m]:
            return f"{m} reaches the model output"
        if m in graph.carries and any(
            p != graph.carries[m] and graph.find(p) == root for p in graph.producers[m]
        ):
            return f"{m} multiplies two operands of one scale (x * f(x) with f homogeneous: scale squared)"
        for c in graph.consumers[m]:
            if (m, c) in graph.cuts:
                continue  # the join multiplies this operand
            if graph.find(c) != root and graph.kinds[c] not in ABSORB_IN:
                return f"{c}, a consumer of {m}, does not pass a scale ({graph.kinds[c]} op)"
    return None


def settle_products(graph: SiteGraph) -> None:
    """A product x * g(x) passes x's scale only where x's class can carry one; elsewhere it
    stays opaque (as any product), so its own fallback (an island on its module) applies."""
    bad = [m for m in graph.carries if class_problem(graph, graph.find(m)) is not None]
    for m in bad:
        del graph.carries[m]
        graph.kinds[m] = Kind.OPAQUE
    if bad:
        graph.recut(graph.cuts)


def _absorbs_out(graph: SiteGraph, site: str) -> bool:
    kind = graph.kinds[site]
    if kind == Kind.NORM:
        return norm_has_affine(graph.modules[site])
    return kind in ABSORB_OUT
