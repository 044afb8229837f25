"""plan(): from a report to regions, factors, re-parametrizations and FP32 islands."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import nn

from fp16lens._core import FP16_MAX, FP16_MIN_NORMAL
from fp16lens._core.algebra import PASSES, Kind, choose_factor, degree, exact_powers, pow2_ceil
from fp16lens._core.sites import FindingKind, Mechanism, is_island
from fp16lens.patch._actisland import mark_activations, rename_islands
from fp16lens.patch._classes import class_problem, settle_products
from fp16lens.patch._cuts import choose_cuts, join_multiplies
from fp16lens.patch._flops import conv_linear_flops
from fp16lens.patch._fxisland import groupable, root_nodes
from fp16lens.patch._graph import Binding, SiteGraph, TorchBinding, build_graph
from fp16lens.patch._inputs import fold_inputs
from fp16lens.patch._modplan import module_changes
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._plan import Plan, Region, Unresolved
from fp16lens.patch._reach import (
    early_exits,
    flushed_regions,
    held,
    host_islands,
    inside,
    mark,
    merged_sites,
    realize,
    span_sites,
    widen,
)
from fp16lens.patch._rules import bn_affine, fp16_safe, scale_bn
from fp16lens.patch._underflow import underflow_islands
from fp16lens.report import Report

_SQUARE = frozenset({FindingKind.NORM_VARIANCE, FindingKind.RMS_SQUARE})


@dataclass
class Demands:
    """What each scale class must hold: (value, power) pairs and the reasons.

    A demand is recorded on a site (``anchors``) and grouped by the site's scale class in
    ``resolve``, so that one collection serves the graph before and after its cuts.
    """

    anchors: list[tuple[str, float, int | Fraction, str]] = field(
        default_factory=list
    )  # (site, v, power, why)
    fallback_at: list[tuple[str, str, str]] = field(default_factory=list)  # (anchor, site, why)
    values: dict[str, list[tuple[float, int | Fraction]]] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    affine: set[str] = field(default_factory=set)  # batch norms to rewrite in affine form
    islands: dict[str, str] = field(default_factory=dict)  # site -> reason (fallback)
    fallback: dict[str, list[tuple[str, str]]] = field(
        default_factory=dict
    )  # class -> (site, reason)s
    weights: dict[str, float] = field(default_factory=dict)  # module -> |parameter| beyond FP16

    def add(self, anchor: str, value: float, power: int | Fraction, reason: str) -> None:
        self.anchors.append((anchor, value, power, reason))

    def resolve(self, graph: SiteGraph) -> Demands:
        """Group the demands by the current scale classes of ``graph``."""
        self.values, self.reasons, self.fallback = {}, {}, {}
        for anchor, value, power, reason in self.anchors:
            root = graph.find(anchor)  # a site at exponent w of the class: p^w divides it
            self.values.setdefault(root, []).append((value, power * graph.weight(anchor)))
            if reason not in self.reasons.setdefault(root, []):
                self.reasons[root].append(reason)
        for anchor, site, reason in self.fallback_at:
            self.fallback.setdefault(graph.find(anchor), []).append((site, reason))
        return self


def build_plan(
    model: nn.Module | None,
    report: Report,
    options: PatchOptions,
    binding: Binding | None = None,
    keep_fp32: Iterable[str] = (),
) -> Plan:
    """``model`` None: an ONNX graph, read through ``binding``. ``keep_fp32``: sites to run in
    FP32 islands from the start (``replan``, ``options.fp32_spans``); the plan grows that set
    until every island hands on values FP16 holds (``patch/_reach.py``)."""
    binding = binding or TorchBinding(model)  # how the sites read the model (an ONNX graph too)
    powers = [_chain_power(report, f.site) for f in report.findings]  # before sites merge
    spans = span_sites(report, getattr(options, "fp32_spans", None) or ())  # before sites merge
    report = binding.contract(report)  # fused norm modules: one site each
    graph = build_graph(model, report, binding)
    acts = (
        {} if model is None else mark_activations(model, graph, report)
    )  # F.silu(x) & co.: islands
    if model is not None and _own_ops_at_stake(report):  # ops of the model's forward: fx islands
        graph.fxnodes = root_nodes(model, report)
        graph.fxgroup = functools.partial(groupable, model, {})
    saved = graph.snapshot()
    why = dict.fromkeys((s for s in keep_fp32 if s in report.sites), "kept FP32 as asked (replan)")
    why.update(
        (s, "its span kept FP32 end to end as asked (fp32_spans)")
        for s in spans
        if s in report.sites
    )
    for _ in range(len(report.sites) + 1):
        graph.restore(saved)
        plan, grow = _plan_once(model, report, options, binding, graph, powers, acts, why)
        if grow.keys() <= why.keys():
            break
        for s, r in grow.items():
            why.setdefault(s, r)
    fold_inputs(
        graph, report, plan, onnx=model is None
    )  # the caller divides, first layers hold 2^k
    kept = [] if model is None else [n for n, m in model.named_modules() if is_island(m)]
    base = dataclasses.replace(
        graph, kinds=saved[0], modules=saved[1]
    )  # FLOPs of the model as built
    plan.fp16_flops, plan.total_flops = conv_linear_flops(base, report, [*kept, *plan.fp32_modules])
    if options.factor is None:
        return plan
    for r in plan.regions:
        over = [
            s
            for s in r.sites
            if report.sites[s].absmax / graph.scale(s, {graph.find(s): r.factor}) > FP16_MAX
        ]
        if over:
            plan.notes.append(f"factor {r.factor:g} leaves {', '.join(over)} beyond {FP16_MAX:g}")
    return plan


def _own_ops_at_stake(report: Report) -> bool:
    """Whether a span or finding names an op of the model's own forward (not a module's)."""
    named = {s for sp in report.spans for s in sp.sites} | {f.site for f in report.findings}
    return any(
        report.sites[s].kind != "module" and not report.sites[s].module
        for s in named
        if s in report.sites
    )


def _plan_once(
    model, report, options, binding, graph, powers, acts, why: dict[str, str]
) -> tuple[Plan, dict]:
    """One plan with the sites ``why`` names (site -> why) in FP32 islands; returns it and
    the sites that must join them, with their reasons (none when every island hands on
    values in range)."""
    plan, fp32 = Plan(), set(why)
    hosts = realize(graph, report, fp32, acts)
    mark(graph, hosts)
    graph.recut(set())
    settle_products(graph)  # x * g(x) passes x's scale only where x's class can carry one
    demands = collect_demands(graph, report, plan, powers).resolve(graph)
    cuts = choose_cuts(model, graph, report, demands, options.extend, binding.mappable)
    if cuts:
        graph.recut(cuts)
        demands.resolve(graph)
    grow: dict[str, str] = {}
    scales = _scale_classes(graph, report, demands, options, plan, (fp32, acts, grow))
    plan.reparametrized, islands = module_changes(graph, scales, demands.affine, demands.islands)
    for owner in demands.islands:  # a fallback island around or inside a host: one island
        if owner not in graph.modules and any(inside(owner, h) or inside(h, owner) for h in hosts):
            for s, st in report.sites.items():
                if inside(s if st.kind == "module" else st.module, owner):
                    grow.setdefault(
                        s, f"{demands.islands[owner]}; one island with the FP32 span beside it"
                    )
    islands = [
        i for i in islands if not any(inside(i.module, h) for h in hosts if not hosts[h].single)
    ]
    for s in early_exits(graph, report, islands, acts):
        grow.setdefault(
            s, f"its island handed on {report.sites[s].absmax:.3g}, beyond FP16: it reaches further"
        )
    on_islands = graph.fp32 | {i.module for i in islands}  # sites that are islands (named by site)
    for s, e in flushed_regions(graph, report, plan.regions, scales, on_islands, acts).items():
        grow.setdefault(
            s,
            f"its region's scale would push small values below FP16's normal range before {e}, "
            "which is singular at 0: kept FP32 with it",
        )
    islands += host_islands(graph, report, hosts, scales, why)
    plan.islands = rename_islands(islands, acts)
    plan.multiplies = join_multiplies(graph, report, scales)
    if model is not None:  # underflow: an exact rule, else the normalization block in FP32
        underflow_islands(
            model, report, plan
        )  # (after the multiplies: a rule keeps off their owners)
    return plan, grow


def replan(
    model: nn.Module | None,
    report: Report,
    options: PatchOptions,
    *,
    binding=None,
    fp32_spans=(),
    fp32_sites: Iterable[str] = (),
    merge=(),
) -> Plan:
    """The seam of patch's widening loop: the plan again, with the spans ``fp32_spans``
    (``Span`` objects, indexes into ``report.spans`` or their start sites) kept FP32 end to
    end, the sites ``fp32_sites`` in FP32 islands, and each group of islands in ``merge``
    (``Island`` objects or their names in ``Plan.islands``) made one FP32 span, the values
    between them FP32. Whatever else the plan needs grows from there as usual. ``model``
    None and ``binding``: an ONNX graph, as ``build_plan`` takes it."""
    keep = {*fp32_sites, *span_sites(report, fp32_spans), *merged_sites(report, merge)}
    return build_plan(model, report, options, binding, keep_fp32=keep)


# ---- demands ------------------------------------------------------------------------
def _chain_power(report: Report, site: str) -> Fraction:
    """The power of its module's input that a functional site's value is (RMS norm's
    mean of x**2: 2), following its producers inside the same module; 1 for a module site."""
    st = report.sites.get(site)
    if st is None or st.kind == "module":
        return Fraction(1)
    power, seen = degree(st.op), {site}
    node = site
    while True:
        inside = [
            p
            for p in report.producers(node)
            if p not in seen
            and report.sites[p].kind != "module"
            and report.sites[p].module == st.module
        ]
        if not inside:
            return power
        node = inside[0]
        seen.add(node)
        power *= degree(report.sites[node].op)


def collect_demands(
    graph: SiteGraph, report: Report, plan: Plan, powers: list | None = None
) -> Demands:
    """Every demand on a site, unresolved ones into ``plan``; ``resolve`` groups them.
    ``powers``: per finding, the power of its module's input its value is (``_chain_power``)."""
    d = Demands()
    for span in report.spans:
        reason = f"span {span.start} -> {span.end or 'output'}"
        for s in span.sites:
            if (
                s not in span.ends
                and s in report.sites
                and s not in graph.frozen
                and not held(graph, s)
            ):
                d.add(s, report.sites[s].absmax, 1, reason)
    for i, f in enumerate(report.findings):
        if f.site in graph.frozen or f.site in graph.fp32:  # an island computes it in FP32
            continue
        if f.mechanism == Mechanism.INTERNAL:
            _internal(graph, f, d, plan, powers[i] if powers else None)
        elif f.mechanism == Mechanism.PARAMETER and f.kind == FindingKind.PARAM_OVERFLOW:
            _parameter(graph, f, d, plan)
    return d


def _internal(graph: SiteGraph, f, d: Demands, plan: Plan, chain: Fraction | None = None) -> None:
    kind = graph.kinds.get(f.site)
    reason = f"{f.kind} in {f.site} ({f.peak:.3g})"
    power: int | Fraction = 2 if f.kind in _SQUARE else 1
    if (
        kind == Kind.NORM
        and f.kind == FindingKind.SUM_BEFORE_MEAN
        and chain is not None
        and chain > 0
    ):
        power = chain  # inside a norm recognized by what it computes: the mean of x**2 (RMS) or x
    norm = kind == Kind.NORM and (f.kind in _SQUARE or f.kind == FindingKind.SUM_BEFORE_MEAN)
    if norm or (kind == Kind.HOMOG and f.kind == FindingKind.SUM_BEFORE_MEAN):
        prods = graph.producers.get(f.site, [])
        anchor = (prods[0] if prods else None) if norm else f.site  # a norm: its input's class
        if anchor is not None:
            d.add(anchor, f.peak, power, reason)
            d.fallback_at.append((anchor, f.site, reason))
            return
    if graph.is_module(f.site):
        d.islands[f.site] = reason
    elif owner := _owner(graph, f.site):
        d.islands[owner] = f"{reason}: {f.site} runs in its module's forward"
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
    if kind == Kind.BN:
        d.affine.add(f.site)
        peak = _affine_peak(graph.modules.get(f.site))
        if peak > FP16_MAX:  # the affine form itself overflows: its output class is scaled
            d.add(f.site, peak, 1, reason)
            d.weights[f.site] = max(d.weights.get(f.site, 0.0), peak)
    elif kind == Kind.LINEAR and f.tensor in ("weight", "bias"):
        d.add(f.site, f.peak, 1, reason)
        d.weights[f.site] = max(d.weights.get(f.site, 0.0), f.peak)
    elif graph.is_module(f.site):
        d.islands[f.site] = reason
    else:
        plan.unresolved.append(Unresolved(f.site, f"{reason}: not a module fp16lens can rewrite"))


def _affine_peak(bn, shift: bool = True) -> float:
    """Largest |scale| (and |shift|) of a batch norm's affine form (0 when not a batch norm)."""
    if bn is None or getattr(bn, "running_var", None) is None:
        return 0.0
    scale, bias = bn_affine(bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias)
    return float(
        torch.cat([scale.abs().flatten(), *([bias.abs().flatten()] if shift else [])]).max()
    )


def _opaque_reason(graph: SiteGraph, site: str, what: str) -> str:
    return (
        f"{what}: {site} is a functional op (not a module), which no scale passes and which "
        "cannot be made an FP32 island on its own; move it into its own nn.Module (then "
        "patch makes it an island) or export with that module in fp32_modules"
    )


# ---- classes -> scales ----------------------------------------------------------------
def _scale_classes(graph, report, demands: Demands, options, plan: Plan, reach) -> dict[str, float]:
    """``reach``: (the sites kept FP32, the planned activation islands, the set that collects
    the sites a failed class puts in FP32)."""
    scales: dict[str, float] = {}
    for root, values in demands.values.items():
        problem = class_problem(graph, root)
        reasons = demands.reasons[root]
        if problem is not None:
            _fail(graph, report, root, problem, reasons, demands, plan, reach)
            continue
        members = graph.members(root)
        low = min(
            (_low(report, s, options.low_share, graph.weight(s)) for s in members), default=0.0
        )
        p = options.factor or choose_factor(values, low, options.target)
        exps = [graph.weight(s) for s in members]
        if any(w != 1 for w in exps):  # powers in the class: every p^w a power of two
            p = exact_powers(p, exps)
        scales[root] = float(p)
        plan.regions.append(_region(graph, report, root, members, float(p), reasons))
    if options.factor is None:
        _fit_weights(graph, report, demands, scales, options.target, plan)
    return scales


def _fit_weights(graph, report, demands: Demands, scales, target: float, plan: Plan) -> None:
    """A module's weights become W s_in / s_out: where its input class is scaled too (an
    exit, or a weight beyond FP16 between two regions), its output class needs a factor
    large enough for the weights to fit (raised until they do; an output class without a
    region gets one where it can carry a scale: an exit conv after a large factor). A
    batch norm in its affine form stores gamma/sqrt(var+eps) s_in / s_out likewise. Where
    the output class can carry no scale and the weights would pass FP16, the module
    becomes a scaled FP32 island (its parameters stay as they are)."""
    for _ in range(len(graph.modules) + 1):
        changed = False
        for site, peak in _fit_peaks(graph, demands, scales).items():
            root_out, s_in = graph.find(site), graph.scale(graph.input_site(site), scales)
            w = graph.weight(site)
            if (
                w <= 0 or site in demands.islands or site in graph.fp32
            ):  # a scale that grows as p shrinks: left as it is
                continue
            members = graph.members(root_out)  # the class's p: need at the site's exponent w
            need = exact_powers(
                pow2_ceil(peak * s_in / target) ** (1 / float(w)),
                [graph.weight(m) for m in members],
            )
            if root_out in scales and need > scales[root_out]:
                scales[root_out], changed = need, True
                plan.regions = [
                    dataclasses.replace(r, factor=need) if r.sites == tuple(members) else r
                    for r in plan.regions
                ]
            elif (
                root_out not in scales
                and need > 1
                and peak * s_in > FP16_MAX  # stored weights need only fit FP16
                and class_problem(graph, root_out) is None
            ):
                scales[root_out], changed = need, True
                why = f"{site} weights x {s_in:g} beyond FP16"
                plan.regions.append(_region(graph, report, root_out, members, need, [why]))
            elif root_out not in scales and peak * s_in > FP16_MAX and graph.is_module(site):
                demands.islands[site] = (
                    f"its parameters x {s_in:g} would pass FP16 and its output cannot carry a "
                    f"scale ({class_problem(graph, root_out)}): FP32 island fed x {s_in:g}"
                )
        if not changed:
            return


def _fit_peaks(graph, demands: Demands, scales) -> dict[str, float]:
    """Per module whose stored weights scale with its input's factor: their largest |value|
    (a conv/linear's weight, a batch norm's affine scale where the scaled statistics would
    not fit FP16)."""
    weights = dict(demands.weights)
    for site, mod in graph.modules.items():
        if graph.input_class(site) not in scales:
            continue
        w, kind = getattr(mod, "weight", None), graph.kinds[site]
        if kind == Kind.LINEAR and isinstance(w, torch.Tensor):
            weights[site] = max(weights.get(site, 0.0), float(w.detach().abs().max()))
        elif kind == Kind.BN and (
            site in demands.affine
            or not _bn_scale_fits(mod, graph.scale(graph.input_site(site), scales))
        ):
            weights[site] = max(weights.get(site, 0.0), _affine_peak(mod, shift=False))
    return weights


def _bn_scale_fits(bn, s_in: float) -> bool:
    """Whether the batch norm's statistics divided by ``s_in`` stay in FP16 (else patch
    rewrites it in its affine form, whose scale carries s_in)."""
    if getattr(bn, "running_var", None) is None:
        return True
    m, v, _, _, _ = scale_bn(bn.running_mean, bn.running_var, bn.eps, None, None, s_in, 1.0)
    return fp16_safe(m, v)


def _low(report: Report, site: str, share: float, w=1) -> float:
    """The site's small significant values as a degree-1 low: p^w may divide them."""
    st = report.sites.get(site)
    q = st.quantile_low(share) if st is not None else 0.0
    if not q > 0 or w <= 0:
        return float("inf")
    return FP16_MIN_NORMAL * (q / FP16_MIN_NORMAL) ** (1 / float(w)) if w != 1 else q


def _fail(graph, report, root, problem, reasons, demands: Demands, plan: Plan, reach) -> None:
    # each internal finding with a module site falls back to an island of that module;
    # what no island covers (a span, a functional op) goes on below, never dropped
    for site, reason in demands.fallback.get(root, []):
        host = site if graph.is_module(site) else _owner(graph, site)  # or its module's forward
        if host is not None:
            demands.islands[host] = f"{reason}; no region: {problem}"
            reasons = [r for r in reasons if r != reason]
    if not reasons:
        return
    fp32, acts, grow = reach
    wider = widen(graph, report, root, fp32, acts)  # FP32 islands reaching where values fit
    for s in wider:
        grow.setdefault(s, f"{'; '.join(reasons)}: no rescaling region ({problem})")
    for r in reasons:
        why = f"{r}: no rescaling region: {problem}"
        if wider:
            why += f"; planned again with {', '.join(sorted(wider))} in FP32"
        plan.unresolved.append(Unresolved(root, why))


def _region(graph, report, root, members, p, reasons) -> Region:
    entries = [m for m in members if graph.kinds[m] not in PASSES]
    exits = []
    for m in members:
        exits += [
            c
            for c in graph.consumers[m]
            if graph.find(c) != root and c not in exits and (m, c) not in graph.cuts
        ]
    peak = max((report.sites[m].absmax for m in members), default=0.0)
    return Region(tuple(members), tuple(entries), tuple(exits), p, peak, tuple(reasons))
