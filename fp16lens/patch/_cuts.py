"""Where a join's operand gets one scalar multiply instead of joining the region.

By default a region grows backwards through homogeneous ops until absorbing producers
(zero run-time cost). Where that growth is blocked (a model input, an op no scale passes,
the model output) or ``extend=False``, a join's operands that are not themselves out of
range are cut off the region and multiplied by a scalar in the join's module (torch.fx).
"""

from __future__ import annotations

from torch import nn

from fp16lens._core import PatchError
from fp16lens._core.algebra import Kind
from fp16lens.patch._classes import class_problem
from fp16lens.patch._fx_read import find_op, operands, producer_site, trace_owner
from fp16lens.patch._graph import SiteGraph
from fp16lens.patch._plan import Multiply
from fp16lens.report import Report


def overflowing(graph: SiteGraph, report: Report) -> set[str]:
    """Sites whose outputs leave FP16 range (span sites other than the ends)."""
    return {
        s for sp in report.spans for s in sp.sites if s not in sp.ends and s not in graph.frozen
    }


def choose_cuts(
    model: nn.Module, graph: SiteGraph, report: Report, demands, extend: bool, mappable=None
) -> set:
    """The (producer, join) pairs to multiply; ``mappable(model, report, join, keep, traced)``
    says where a multiply can go (default: the join's owner traces with torch.fx)."""
    mappable = mappable or _mappable
    over = overflowing(graph, report)
    cuts: set[tuple[str, str]] = set()
    traced: dict[str, object] = {}
    for root in demands.values:
        if extend and class_problem(graph, root) is None:
            continue
        for join in (m for m in graph.members(root) if graph.kinds[m] == Kind.JOIN):
            keep = [p for p in graph.producers[join] if p in over]
            cut = [p for p in graph.producers[join] if p not in keep]
            if cut and mappable(model, report, join, keep, traced):
                cuts.update((p, join) for p in cut)
    return cuts


def _mappable(model, report: Report, join: str, keep: list[str], traced: dict) -> bool:
    """True when the join's owner traces and each kept producer is one operand in fx."""
    owner = report.sites[join].module
    try:
        gm = traced.get(owner) or traced.setdefault(owner, trace_owner(model, owner))
        node = find_op(gm, join)
    except PatchError:
        return False
    found = [producer_site(a, owner) for a in operands(node)]
    return all(found.count(k) == 1 for k in keep)


def join_multiplies(graph: SiteGraph, report: Report, scales: dict[str, float]) -> list[Multiply]:
    out = []
    for join in graph.kinds:
        cut = [p for p in graph.producers[join] if (p, join) in graph.cuts]
        if not cut:
            continue
        s_join = graph.scale(join, scales)
        groups: dict[float, list[str]] = {}  # operands from different regions: one each
        for p in cut:
            groups.setdefault(graph.scale(p, scales) / s_join, []).append(p)
        for ratio, group in groups.items():
            if ratio == 1.0:
                continue
            keep = tuple(p for p in graph.producers[join] if p not in group)
            out.append(Multiply(join, report.sites[join].module, ratio, keep, tuple(group)))
    return out
