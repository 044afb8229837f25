"""plan(): from a report to regions, factors, re-parametrizations and FP32 islands."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fp16lens.patch._classes import class_problem
from fp16lens.patch._classify import (
    HOMOG,
    JOIN,
    NORM,
)
from fp16lens.patch._cuts import choose_cuts, join_multiplies
from fp16lens.patch._factor import choose_factor
from fp16lens.patch._graph import SiteGraph, build_graph
from fp16lens.patch._modplan import module_changes
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._plan import Plan, Region, Unresolved
from fp16lens.report import Report

_SQUARE = frozenset({"norm-variance", "rms-square"})


@dataclass
class Demands:
    """What each scale class must hold: (value, power) pairs and the reasons."""

    values: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    affine: set[str] = field(default_factory=set)  # batch norms to rewrite in affine form
    islands: dict[str, str] = field(default_factory=dict)  # site -> reason (fallback)
    fallback: dict[str, tuple[str, str]] = field(default_factory=dict)  # class -> (site, reason)

    def add(self, root: str, value: float, power: int, reason: str) -> None:
        self.values.setdefault(root, []).append((value, power))
        if reason not in self.reasons.setdefault(root, []):
            self.reasons[root].append(reason)


def build_plan(model: nn.Module, report: Report, options: PatchOptions) -> Plan:
    graph = build_graph(model, report)
    plan, demands = Plan(), collect_demands(graph, report, Plan())
    cuts = choose_cuts(model, graph, report, demands, options.extend)
    if cuts:
        graph.recut(cuts)
    demands = collect_demands(graph, report, plan)
    scales = _scale_classes(graph, report, demands, options, plan)
    plan.reparametrized, plan.islands = module_changes(
        graph, scales, demands.affine, demands.islands
    )
    plan.multiplies = join_multiplies(graph, report, scales)
    if options.factor is None:
        return plan
    for r in plan.regions:
        over = [s for s in r.sites if report.sites[s].absmax / r.factor > 65504]
        if over:
            plan.notes.append(f"factor {r.factor:g} leaves {', '.join(over)} beyond 65504")
    return plan


# ---- demands ------------------------------------------------------------------------
def collect_demands(graph: SiteGraph, report: Report, plan: Plan) -> Demands:
    d = Demands()
    for span in report.spans:
        reason = f"span {span.start} -> {span.end or 'output'}"
        for s in span.sites:
            if s not in span.ends and s in report.sites and s not in graph.frozen:
                d.add(graph.find(s), report.sites[s].absmax, 1, reason)
    for f in report.findings:
        if f.site in graph.frozen:
            continue
        if f.mechanism == "internal":
            _internal(graph, f, d, plan)
        elif f.mechanism == "parameter" and f.kind == "param-overflow":
            _parameter(graph, f, d, plan)
    return d


def _internal(graph: SiteGraph, f, d: Demands, plan: Plan) -> None:
    kind = graph.kinds.get(f.site)
    reason = f"{f.kind} in {f.site} ({f.peak:.3g})"
    power = 2 if f.kind in _SQUARE else 1
    if (kind == NORM and f.kind in _SQUARE) or (kind == HOMOG and f.kind == "sum-before-mean"):
        root = graph.input_class(f.site) if kind == NORM else graph.find(f.site)
        if root is not None:
            d.add(root, f.peak, power, reason)
            d.fallback[root] = (f.site, reason)
            return
    if f.site in graph.modules:
        d.islands[f.site] = reason
    elif _owner(graph, f.site):
        d.islands[_owner(graph, f.site)] = f"{reason}: {f.site} runs in its module's forward"
    else:
        plan.unresolved.append(Unresolved(f.site, _opaque_reason(graph, f.site, reason)))


def _owner(graph: SiteGraph, site: str) -> str | None:
    """The module whose forward runs functional op ``site`` (``block:mul`` -> ``block``),
    when it is a rewritable module other than the root: the fallback FP32 island."""
    owner, sep, _ = site.partition(":")
    return owner if sep and owner and owner in graph.owners else None


def _parameter(graph: SiteGraph, f, d: Demands, plan: Plan) -> None:
    kind = graph.kinds.get(f.site)
    reason = f"{f.site}.{f.tensor} beyond FP16 ({f.peak:.3g})"
    if kind == "bn":
        d.affine.add(f.site)
    elif kind == "linear" and f.tensor in ("weight", "bias"):
        d.add(graph.find(f.site), f.peak, 1, reason)
    elif f.site in graph.modules:
        d.islands[f.site] = reason
    else:
        plan.unresolved.append(Unresolved(f.site, f"{reason}: not a module fp16lens can rewrite"))


def _opaque_reason(graph: SiteGraph, site: str, what: str) -> str:
    return (
        f"{what}: {site} is a functional op (not a module), which no scale passes and which "
        "cannot be made an FP32 island on its own; move it into its own nn.Module (then "
        "patch makes it an island) or export with that module in fp32_modules"
    )


# ---- classes -> scales ----------------------------------------------------------------
def _scale_classes(graph, report, demands: Demands, options, plan: Plan) -> dict[str, float]:
    scales: dict[str, float] = {}
    for root, values in demands.values.items():
        problem = class_problem(graph, root)
        reasons = demands.reasons[root]
        if problem is not None:
            _fail(graph, root, problem, reasons, demands, plan)
            continue
        members = graph.members(root)
        low = min((_low(report, s, options.low_share) for s in members), default=0.0)
        p = options.factor or choose_factor(values, low, options.target)
        scales[root] = float(p)
        plan.regions.append(_region(graph, report, root, members, float(p), reasons))
    return scales


def _low(report: Report, site: str, share: float) -> float:
    st = report.sites.get(site)
    q = st.quantile_low(share) if st is not None else 0.0
    return q if q > 0 else float("inf")


def _fail(graph, root, problem, reasons, demands: Demands, plan: Plan) -> None:
    site_reason = demands.fallback.get(root)
    if site_reason is not None and site_reason[0] in graph.modules:
        demands.islands[site_reason[0]] = f"{site_reason[1]}; no region: {problem}"
        return
    owners = {_owner(graph, m) for m in graph.members(root)}
    if owners and None not in owners:  # every member is a functional op inside some module
        for owner in sorted(owners):
            demands.islands[owner] = f"{'; '.join(reasons)}; no region ({problem}): FP32 island on the owning module"
        return
    for r in reasons:
        plan.unresolved.append(Unresolved(root, f"{r}: no rescaling region: {problem}"))


def _region(graph, report, root, members, p, reasons) -> Region:
    entries = [m for m in members if graph.kinds[m] not in (HOMOG, JOIN)]
    exits = []
    for m in members:
        exits += [
            c
            for c in graph.consumers[m]
            if graph.find(c) != root and c not in exits and (m, c) not in graph.cuts
        ]
    peak = max((report.sites[m].absmax for m in members), default=0.0)
    return Region(tuple(members), tuple(entries), tuple(exits), p, peak, tuple(reasons))
