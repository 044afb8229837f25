"""The fix for an overflow span, as fp16lens.patch plans it, in words.

A span is rescaled when a region exists (docs/DESIGN.md, the rescaling algebra): absorbing
entries (conv/linear/BN, or the producers of a homogeneous start), homogeneous or
absorbing ops inside, absorbing or scale-invariant exits. A blocking *module* inside
(GELU, Sigmoid) becomes a scaled FP32 island; a blocking *functional* op cannot be
wrapped, and a span reaching the model output has no exit: both need an FP32 island
the user places (a module, or fp32_modules at export).
"""

from __future__ import annotations

from dataclasses import dataclass

from fp16lens._core.algebra import (
    OpClass,
    is_join,
    is_product,
    product_carrier,
    rescale_exponent,
    site_class,
)
from fp16lens._core.sites import FindingKind, in_branch
from fp16lens.report._fmt import collapse, value
from fp16lens.report._model import Report, Span

__all__ = ["SpanPlan", "plan_span", "rescale_exponent", "side_inputs", "span_fix"]

PATH_KEEP = 7


def _op(report: Report, site: str) -> str:
    stats = report.sites.get(site)
    return stats.op if stats else "?"


def _cls(report: Report, site: str) -> str:
    """The site's class as patch treats it (a join fed by one tensor adds a constant)."""
    stats = report.sites.get(site)
    if stats is None:
        return OpClass.BLOCKING
    producers = len(set(report.producers(site))) if report.edges else None
    if _carrier(report, site) is not None:  # x * g(x): x's scale passes (g must be unscaled)
        return OpClass.HOMOGENEOUS
    return site_class(stats.op, module=stats.kind == "module", producers=producers)


def _carrier(report: Report, site: str) -> str | None:
    """For a product x * g(x) (squeeze-excitation), x: the operand that carries its scale."""
    stats = report.sites.get(site)
    if stats is None or stats.kind == "module" or not is_product(stats.op):
        return None
    graph: dict[str, list[str]] = {}
    for p, c in report.edges:
        graph.setdefault(c, []).append(p)
    return product_carrier(site, graph)


def _gate_scaled(report: Report, span: Span, site: str) -> bool:
    """A product x * g(x) whose gate g is in the span: the scale would reach g (no region)."""
    carrier = _carrier(report, site)
    return carrier is not None and any(
        p != carrier and p in span.sites for p in report.producers(site)
    )


def _is_island(report: Report, site: str) -> bool:
    """A blocking built-in module: patch can run it as a scaled FP32 island."""
    stats = report.sites.get(site)
    return stats is not None and stats.kind == "module" and _cls(report, site) == OpClass.BLOCKING


def _desc(report: Report, sites: list[str]) -> str:
    return ", ".join(
        f"{s} ({_op(report, s)})" for s in collapse(sites, 4) if not s.startswith("… ")
    )


def _path(names: list[str]) -> str:
    return " → ".join(collapse(names, PATH_KEEP))


@dataclass(frozen=True)
class SpanPlan:
    """What patch does for one span: a rescaling region, or why there is none."""

    k: int | None
    entries: tuple[str, ...] = ()  # absorb 2^-k in their parameters
    exits: tuple[str, ...] = ()  # absorbing ends: undo 2^k
    invariant: tuple[str, ...] = ()  # scale-invariant ends: eps / 4^k
    islands: tuple[str, ...] = ()  # blocking modules run as scaled FP32 islands
    inner: tuple[str, ...] = ()  # absorbing ops inside: biases scaled by 2^-k
    opaque: tuple[str, ...] = ()  # blocking functional ops: no automatic fix
    problem: str = ""  # why no rescaling region exists ("" when one does)


def _absorbs(report: Report, site: str) -> bool:
    return _cls(report, site) == OpClass.ABSORBING or _is_island(report, site)


def _entries(report: Report, span: Span) -> tuple[list[str], str]:
    """Where 2^-k enters: the start, or (for a homogeneous start) the absorbing ops found
    upstream through homogeneous ones, as patch's scale classes do."""
    if _absorbs(report, span.start) or _cls(report, span.start) == OpClass.INVARIANT:
        return [span.start], ""
    entries: set[str] = set()
    todo, seen = [span.start], {span.start}
    while todo:
        site = todo.pop()
        producers = sorted(set(report.producers(site)))
        if not producers:
            return [], f"{site} takes a model input, which carries no scale"
        for p in producers:
            if _absorbs(report, p):
                entries.add(p)
            elif _cls(report, p) != OpClass.HOMOGENEOUS:
                return [], f"{p} ({_op(report, p)}) cannot take 2^-k in its parameters"
            elif p not in seen:
                seen.add(p)
                todo.append(p)
    return sorted(entries), ""


def _exit_problem(report: Report, span: Span) -> str:
    for end in span.ends:
        if _cls(report, end) == OpClass.HOMOGENEOUS:
            return f"{end} ({_op(report, end)}) would pass the scale on instead of undoing it"
    return ""


def plan_span(report: Report, span: Span) -> SpanPlan:
    """The region patch would build for ``span``, from op classes and the dataflow."""
    k = rescale_exponent(span.peak)
    if k is None:
        return SpanPlan(k, problem="inf/NaN already in FP32")
    opaque = tuple(
        s
        for s in span.sites
        if (_cls(report, s) == OpClass.BLOCKING and not _is_island(report, s))
        or _gate_scaled(report, span, s)
    )
    if opaque:
        return SpanPlan(k, opaque=opaque, problem="a functional op no scale passes")
    if span.reaches_output:
        return SpanPlan(k, problem="the values reach the model output out of range")
    entries, problem = _entries(report, span)
    problem = problem or _exit_problem(report, span)
    if problem:
        return SpanPlan(k, problem=problem)
    ends = set(span.ends)
    return SpanPlan(
        k,
        entries=tuple(entries),
        exits=tuple(e for e in span.ends if _cls(report, e) == OpClass.ABSORBING),
        invariant=tuple(e for e in span.ends if _cls(report, e) == OpClass.INVARIANT),
        islands=tuple(s for s in span.sites if _is_island(report, s)),
        inner=tuple(
            s
            for s in span.sites
            if s not in ends and s not in entries and _cls(report, s) == OpClass.ABSORBING
        ),
    )


def side_inputs(report: Report, span: Span) -> list[tuple[str, str]]:
    """(producer, site) pairs where a tensor from outside joins the span at an add/cat.

    Only multi-input ops count: a module site called twice (a shared ReLU) has
    producers from both calls, and its other call is not part of the span.
    """
    members = set(span.sites)
    inner = [
        s for s in span.sites if s != span.start and s not in span.ends and is_join(_op(report, s))
    ]
    return [(p, s) for s in inner for p in report.producers(s) if p not in members]


def _rescale_text(report: Report, span: Span, plan: SpanPlan) -> str:
    k = plan.k
    assert k is not None  # span_fix words a plan without k (inf/NaN in FP32) before this
    where = (
        f"folded into {', '.join(plan.entries)} parameters"
        if all(_cls(report, e) != OpClass.BLOCKING for e in plan.entries)
        else f"starting at {', '.join(plan.entries)}"
    )
    text = (
        f"rescale by 2^-{k} {where} (k = ceil(log2({value(span.peak)} / 2^13)) = {k}: "
        f"the peak becomes {value(span.peak / 2**k)})"
    )
    if plan.exits:
        text += f", undone by 2^{k} in {', '.join(plan.exits)}"
    if plan.invariant:
        text += f"; {', '.join(plan.invariant)} need no change (scale-invariant, eps/4^{k})"
    if plan.inner:
        text += f"; the biases inside ({', '.join(collapse(list(plan.inner), 4))}) are scaled by 2^-{k} too"
    for producer, site in side_inputs(report, span)[:3]:
        text += f"; the other input of {site} (from {producer}) is scaled by 2^-{k} too"
    if plan.islands:
        text += (
            f"; {', '.join(plan.islands)} cannot carry a scale, so each computes in FP32 "
            f"on its input·2^{k} and returns its output·2^-{k}"
        )
    return text + "; exact in FP32"


def _opaque_text(report: Report, span: Span, plan: SpanPlan) -> str:
    owners = sorted({(report.sites[s].module if s in report.sites else "") for s in plan.opaque})
    keep = ", ".join(o or "the root module" for o in owners)
    return (
        f"FP32 island around {_desc(report, list(plan.opaque))}: functional ops (not "
        "modules), so no scale passes them and patch cannot wrap them on their own; move "
        "each into its own nn.Module (patch then makes it an island) or keep "
        f"{keep} in FP32 at export (fp32_modules)"
    )


def _island_text(report: Report, span: Span, plan: SpanPlan) -> str:
    tail = span.ends[-1] if span.ends else span.sites[-1]
    where = (
        f"cast to FP32 before {span.start} and keep the model output in FP32"
        if span.reaches_output
        else f"cast to FP32 before {span.start} and back to FP16 after {tail}"
    )
    return (
        f"FP32 island around {_path(span.sites)}: no rescaling region ({plan.problem}), so {where}"
    )


def _branch_text(span: Span) -> str:
    """A span that starts inside an ONNX If branch the scan inlined: patch rewrites the
    main graph only (it refuses this span), and export keeps If nodes FP32."""
    return (
        f"{span.start} lies inside an If branch: fp16lens.export keeps If nodes in FP32 (no "
        "overflow, no FP16 speed there); to run the branch in FP16, feed the input the model "
        "expects (its scale, e.g. audio in [-1, 1]) or export the model with that branch's "
        "path fixed (no If) and patch that file"
    )


def span_fix(report: Report, span: Span) -> str:
    """What patch does for ``span``, in one sentence."""
    plan = plan_span(report, span)
    if plan.k is None:
        return (
            f"fix the model at {span.start} first: it produces inf/NaN already in FP32 "
            "(a division by zero, log(0), an exploding weight); no FP16 setting can help"
        )
    if in_branch(span.start) and any(f.kind == FindingKind.INLINED for f in report.findings):
        fix = _branch_text(span)
    elif plan.opaque:
        fix = _opaque_text(report, span, plan)
    elif plan.problem:
        fix = _island_text(report, span, plan)
    elif plan.islands:
        fix = f"FP32 island around {_desc(report, list(plan.islands))}, inside a " + (
            _rescale_text(report, span, plan)
        )
    else:
        fix = _rescale_text(report, span, plan) + ", no run-time cost"
    if span.fused:
        fix += (
            "; TensorRT keeps this inside one fused kernel, where it is never stored in "
            "FP16: the fix matters for runtimes that do not fuse it"
        )
    return fix
