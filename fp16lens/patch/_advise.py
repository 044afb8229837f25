"""advise(): the report's advice is patch's plan.

watch and scan call ``advise`` on the report they make, with the model they watched: the
planner that ``patch`` applies plans it once (the plan ``patch`` applies without batches,
``_patch.without_batches``), the plan is stored in the report as data (``Report.advice``),
and each span's and finding's fix is worded from the plan entries that fix it
(``Span.fix``, ``Finding.fix``). The report layer renders those words; it never plans.

An item is fixed by the plan entries that name it: a region, island or unresolved entry
whose reasons name the span (``span START -> END``), the finding (``KIND in SITE``,
``SITE.TENSOR beyond FP16``), or which holds one of its sites.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings

from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._plan import Island, Plan
from fp16lens.report import PATCH_SAYS, Advice, Finding, Report, Span, words_fix

__all__ = ["advice_of", "advise", "plan_words"]

_ABSORB_RULES = ("linear", "bn-scale")
"""Re-parametrizations that only absorb a region's 2^k: its words already say so."""
_BY_HAND = (FindingKind.PARAM_UNDERFLOW, FindingKind.PARAM_SUBNORMAL, FindingKind.SOFTMAX_EXP)
"""Findings patch does not change by design: their words stay the report's, said so."""


def _problems(report: Report) -> bool:
    return bool(report.spans) or any(f.mechanism != Mechanism.NOTE for f in report.findings)


def advise(model, report: Report, options: PatchOptions | None = None) -> Report:
    """Store in ``report`` (in place; returned) what ``fp16lens.patch(model, report)`` does
    for it: ``report.advice`` (the plan as data) and each span's and finding's fix in words
    from the plan. ``model`` is the module or ONNX graph the report was made from. A report
    with nothing to fix is left as it is. Where the planner cannot plan, ``advice.error``
    says why and the fixes are worded from the report alone."""
    if not _problems(report):
        return report
    opts = options or PatchOptions()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # planning only: patch() itself warns
            the_plan = _plan(model, report, opts)
    except Exception as exc:  # the report stays useful: the error is shown, never hidden
        report.advice = Advice(
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
        return report
    report.advice = advice_of(the_plan)
    for span in report.spans:
        span.fix = plan_words(report, the_plan, span)
    for f in report.findings:
        if f.mechanism != Mechanism.NOTE:
            f.fix = plan_words(report, the_plan, f)
    return report


def _plan(model, report: Report, opts: PatchOptions) -> Plan:
    from fp16lens._core.onnx_types import is_onnx
    from fp16lens.patch._patch import _require, without_batches

    if is_onnx(model):
        from fp16lens.patch.onnx import plan_onnx

        return plan_onnx(model, report, opts)
    _require(model, report)
    return without_batches(model, report, opts)


def advice_of(the_plan: Plan) -> Advice:
    """The plan as the report stores it (plain data)."""
    rows = json.loads(
        json.dumps(
            {  # as the report's JSON holds them (tuples become lists)
                "regions": [dataclasses.asdict(r) for r in the_plan.regions],
                "islands": [dataclasses.asdict(i) for i in the_plan.islands],
                "reparametrized": [dataclasses.asdict(r) for r in the_plan.reparametrized],
                "unresolved": [dataclasses.asdict(u) for u in the_plan.unresolved],
                "input_scales": {str(k): v for k, v in the_plan.input_scales.items()},
                "widened": [dataclasses.asdict(w) for w in the_plan.widened],
                "underflow_rules": [dataclasses.asdict(u) for u in the_plan.underflow_rules],
            },
            allow_nan=True,
        )
    )
    return Advice(**rows)


# ---- which plan entries fix an item ---------------------------------------------------
def _keys(
    report: Report, item: Span | Finding, aliases: dict[str, str] | None = None
) -> tuple[set[str], tuple[str, ...]]:
    """The item's sites and the phrases by which the planner's reasons name it (a site
    the planner knows by another name, ``Plan.aliases``, by that name too)."""
    if isinstance(item, Span):
        keys: tuple[str, ...] = (f"span {item.start} -> {item.end or 'output'}",)
        merged = {(aliases or {}).get(s, s) for s in item.sites}
        if aliases and len(merged) == 1:  # a decomposed norm's own (x-mean)^2: its finding
            keys += (f"{FindingKind.NORM_VARIANCE} in {merged.pop()} (",)
        return set(item.sites), keys
    sites = {item.site} | ({item.tensor} if item.tensor in report.sites else set())
    if item.mechanism == Mechanism.PARAMETER:
        return sites, (f"{item.site}.{item.tensor} beyond FP16",)
    if item.mechanism == Mechanism.INTERNAL:
        known = dict.fromkeys((item.site, (aliases or {}).get(item.site, item.site)))
        return sites, tuple(f"{item.kind} in {name} (" for name in known)
    if item.mechanism == Mechanism.UNDERFLOW:  # each island of the chain before it names it
        return sites, (f" {item.site} run in FP32", f"in the FP32 chain to {item.site}")
    if item.mechanism == Mechanism.OUTPUT:  # the span that starts there names it
        return sites, tuple(
            f"span {s.start} -> {s.end or 'output'}" for s in report.spans if s.start == item.site
        )
    return sites, ()


def _owner(report: Report, site: str) -> str:
    st = report.sites.get(site)
    if st is None:
        return site
    return site if st.kind == "module" else st.module


def _inside(name: str, host: str) -> bool:
    return host == "" or name == host or name.startswith(host + ".")


def _island_holds(report: Report, island: Island, site: str) -> bool:
    if island.site:
        return island.site == site
    owner = _owner(report, site)
    return _inside(owner, island.module) and (
        island.module != "" or not owner or site in report.sites
    )


def _names(reasons, keys: tuple[str, ...]) -> bool:
    text = " | ".join(reasons) if not isinstance(reasons, str) else reasons
    return any(k and k in text for k in keys)


def _fixing(report: Report, the_plan: Plan, item: Span | Finding):
    sites, keys = _keys(report, item, the_plan.aliases)
    regions = [
        r
        for r in the_plan.regions
        if _names(r.reasons, keys) or (isinstance(item, Span) and sites & set(r.sites))
    ]
    ends = {
        m for r in regions for m in (*r.entries, *r.exits)
    }  # a region's end that cannot hold its scale
    islands = [
        i
        for i in the_plan.islands
        if _names(i.reason, keys)
        or i.module in ends
        or any(_island_holds(report, i, s) for s in sites)
    ]
    reparams = [r for r in the_plan.reparametrized if r.rule != "input" and r.module in sites]
    unresolved = [u for u in the_plan.unresolved if u.site in sites or _names(u.reason, keys)]
    widened = [
        w
        for w in the_plan.widened
        if isinstance(item, Span)
        and 0 <= w.span < len(report.spans)
        and report.spans[w.span] is item
    ]
    rules = [u for u in the_plan.underflow_rules if u.site in sites]
    return regions, islands, reparams, unresolved, widened, rules


# ---- words ------------------------------------------------------------------------------
def _k(factor: float) -> int:
    return round(math.log2(factor)) if factor > 0 else 0


def _list(names, keep: int = 4) -> str:
    names = list(dict.fromkeys(names))
    more = f" and {len(names) - keep} more" if len(names) > keep else ""
    return ", ".join(names[:keep]) + more


_RULE = re.compile(r"\(rule: [^)]*\)")
"""How the planner names the rule behind an entry, in its reason ("(rule: FP32 island of the block)")."""


def _value(v: float) -> str:
    """1.49e5, 4.67e3, 20: as the report writes values."""
    return f"{v:.3g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def _region_words(r) -> str:
    k = _k(r.factor)
    text = f"rescale by 2^-{k} (the peak {_value(r.peak)} becomes {_value(r.peak / r.factor)})"
    if r.entries:
        text += f": {_list(r.entries)} absorb 2^-{k} in their parameters"
    if r.exits:
        text += f", {_list(r.exits)} undo it"
    rules = list(
        dict.fromkeys(m.group(0)[1:-1] for reason in r.reasons for m in _RULE.finditer(reason))
    )
    return text + (f" ({'; '.join(rules)})" if rules else "")


def _rule_words(u) -> str:
    where = f"folded into {u.folded}" if u.folded else "one multiply at the block's input"
    return (
        f"exact rule {u.rule}: the block scaled up by 2^{u.exponent} ({where}), ended at {u.site}"
    )


def _island_name(i: Island) -> str:
    what = i.module or "the whole model"
    return f"{i.site} (as {i.module})" if i.site and i.module != i.site else what


def _island_parts(i: Island, handing: bool = True) -> list[str]:
    parts = []
    if i.in_scale != 1:
        parts.append(f"its input × 2^{_k(i.in_scale)}")
    if i.out_scale != 1:
        parts.append(f"its output × 2^-{_k(i.out_scale)}")
    if handing and i.fp32_out:
        parts.append("handing its output on in FP32")
    if handing and i.fp32_in:
        parts.append("fed FP32 by the island before it")
    rule = _RULE.search(i.reason)
    if rule:
        parts.append(rule.group(0)[1:-1])
    return parts


def _island_words(i: Island) -> str:
    parts = _island_parts(i)
    return f"FP32 island {_island_name(i)}" + (f" ({', '.join(parts)})" if parts else "")


_CHAIN = 3
"""More islands than this for one item are worded as one list, in the model's order."""


def _islands_words(report: Report, islands: list[Island]) -> list[str]:
    """The islands fixing one item, in the order the model runs them; more than ``_CHAIN``
    as one list whose FP32 hand-overs are said once."""
    first: dict[str, int] = {}
    for k, (name, st) in enumerate(report.sites.items()):
        for key in (name, st.module):
            first.setdefault(key, k)
    islands = sorted(islands, key=lambda i: first.get(i.site or i.module, len(first)))
    if len(islands) <= _CHAIN:
        return [_island_words(i) for i in islands]
    names = []
    for i in islands:
        parts = _island_parts(i, handing=False)
        names.append(_island_name(i) + (f" ({', '.join(parts)})" if parts else ""))
    handed = sum(i.fp32_in for i in islands)
    tail = f"; {handed} of them fed FP32 by the island before" if handed else ""
    return [f"FP32 islands ({len(islands)}, in order): {', '.join(names)}{tail}"]


def _input_words(report: Report, the_plan: Plan, f: Finding) -> str | None:
    index = int(f.site[f.site.index("[") + 1 : f.site.index("]")]) if "[" in f.site else 0
    p = the_plan.input_scales.get(index)
    if p is None:
        return None
    readers = [r.module for r in the_plan.reparametrized if r.rule == "input"]
    return (
        f"{PATCH_SAYS}2^{_k(p)} folded into the weights of {_list(readers)}; the caller divides input {index} "
        f"by 2^{_k(p)} before the patched model runs (plan.scale_inputs(*inputs) does it)"
    )


def plan_words(report: Report, the_plan: Plan, item: Span | Finding) -> str:
    """What ``the_plan`` does for ``item``, in one sentence ("patch: ...")."""
    if not math.isfinite(item.peak):
        return words_fix(report, item)  # inf/NaN already in FP32: no FP16 setting helps
    if isinstance(item, Finding) and item.mechanism == Mechanism.INPUT:
        words = _input_words(report, the_plan, item)
        if words is not None:
            return words
    regions, islands, reparams, unresolved, widened, rules = _fixing(report, the_plan, item)
    parts = [_rule_words(u) for u in rules]
    parts += [_region_words(r) for r in regions]
    ends = {m for r in regions for m in (*r.entries, *r.exits)}
    parts += [
        f"{r.module} re-parametrized ({r.rule}: {r.detail})"
        for r in reparams
        if not (r.rule in _ABSORB_RULES and r.module in ends)
    ]  # said by its region
    parts += _islands_words(report, islands)
    parts += [f"{_list(w.modules) or 'the whole model'} kept FP32 end to end" for w in widened]
    if (regions or rules) and not islands and not unresolved:
        parts[-1] += "; exact in FP32, no run-time cost"
    parts += [f"unresolved: {u.reason}" for u in unresolved]
    if not parts:
        if isinstance(item, Finding) and item.kind in _BY_HAND:
            return f"patch leaves it as it is; by hand: {words_fix(report, item)}"
        return f"patch plans nothing for it; by hand: {words_fix(report, item)}"
    text = PATCH_SAYS + "; ".join(parts)
    if isinstance(item, Span) and item.fused:
        text += (
            "; TensorRT keeps this inside one fused kernel, where it is never stored in "
            "FP16: the fix matters for runtimes that do not fuse it"
        )
    return text
