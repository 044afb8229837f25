"""The fix for underflow findings (mechanism ``underflow``): first an exact rule of the
algebra (``_underflow_rules.py``: the block scaled up by 2^j, ended by the log, the ratio
or the power), else one FP32 island covering the normalization block, from the site where
the values flush through the op where their zeros become non-finite.

The island is the smallest module whose forward runs both (their common ancestor in the
module tree): inside it nothing is stored in FP16, so the small values keep their FP32
magnitude until the log or the divide has turned them into ordinary numbers. It is always
correct; the exact rule keeps the block in FP16 and is tried first in that same module.
A block whose common ancestor is the model itself cannot be an island: it stays
unresolved with that reason.
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from fp16lens._core.sites import Mechanism, site_module
from fp16lens.patch._plan import Island, Plan, Reparam, UnderflowRule, Unresolved
from fp16lens.patch._underflow_rules import NoRule, plan_rule
from fp16lens.report import Report


def _common(a: str, b: str) -> str:
    """The deepest module holding both qualified names ("" = the model)."""
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    out = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def _inside(name: str, outer: str) -> bool:
    return not outer or name == outer or name.startswith(outer + ".")


def underflow_islands(model: nn.Module | None, report: Report, plan: Plan) -> None:
    """Add to ``plan`` one FP32 island per underflow block (merged when one holds another)."""
    if model is None:
        return
    wanted: dict[str, list[str]] = {}
    root = None  # whether a block in the model's own forward is fixed by an exact rule
    for f in report.findings:
        if f.mechanism != Mechanism.UNDERFLOW:
            continue
        origin = f.tensor if f.tensor in report.sites else f.site
        owner = _common(site_module(origin), site_module(f.site))
        if not owner and root is None:  # no island can hold it; a rule may rewrite the forward
            root = not plan.changes and _exact(model, report, plan, "")
        if not owner and root:
            continue
        if not owner:
            plan.unresolved.append(
                Unresolved(
                    f.site,
                    (
                        f"underflow at {f.site} (values flushed at {origin}): the block from {origin} to "
                        f"{f.site} runs in the model's own forward, which cannot be an FP32 island; move "
                        "it into a submodule (then patch keeps that one in FP32) or keep the model in FP32"
                    ),
                )
            )
            continue
        wanted.setdefault(owner, []).append(
            f"underflow: {f.site} ({f.count} non-finite, values flushed at {origin})"
        )
    taken = [i.module for i in [*plan.kept, *plan.islands]]
    for owner in sorted(wanted, key=len):
        if not any(_inside(owner, t) or _inside(t, owner) for t in taken) and _exact(
            model, report, plan, owner
        ):
            continue
        if any(_inside(owner, t) for t in taken):  # already FP32 inside an island: say so
            at = next((k for k, i in enumerate(plan.islands) if _inside(owner, i.module)), None)
            if at is not None:
                isl = plan.islands[at]
                plan.islands[at] = dataclasses.replace(
                    isl, reason=f"{isl.reason}; also fixes " + "; ".join(wanted[owner])
                )
            continue
        if any(_inside(t, owner) for t in taken):
            plan.notes.append(f"underflow island {owner} holds another island: left to that one")
            continue
        try:
            model.get_submodule(owner)
        except AttributeError:
            continue
        why = [
            n.split(": ", 1)[1]
            for n in plan.notes
            if n.startswith(f"no exact underflow rule in {owner}: ")
        ]
        plan.islands.append(
            Island(
                owner,
                1.0,
                1.0,
                "; ".join(wanted[owner])
                + " (rule: FP32 island of the block"
                + (f"; no exact rule: {why[-1]}" if why else "")
                + ")",
            )
        )
        taken.append(owner)
        handed = _handed_back(report, owner)
        if handed:
            plan.notes.append(
                f"the FP32 island {owner} hands back values below 2^-24 that FP16 makes 0 "
                f"({', '.join(handed[:3])}): harmless unless a log or divide outside reads them "
                "(a scan of the patched model says)"
            )


def _exact(model: nn.Module, report: Report, plan: Plan, owner: str) -> bool:
    """Every underflow finding of block ``owner`` fixed by an exact rule (added to ``plan``);
    False, with a note saying why, where one is not (the island then covers them all)."""
    found = [
        f
        for f in report.findings
        if f.mechanism == Mechanism.UNDERFLOW
        and _common(
            site_module(f.tensor if f.tensor in report.sites else f.site), site_module(f.site)
        )
        == owner
    ]
    taken = (
        {r.module for r in plan.reparametrized}
        | {s for r in plan.regions for s in r.sites}
        | {i.module for i in [*plan.kept, *plan.islands]}
        | {m.owner for m in plan.multiplies}
        | {site_module(i.site) for i in plan.islands if i.site}
    )  # forwards fx rewrites for other fixes
    if owner in taken:
        return False
    rules: list[UnderflowRule] = []
    try:
        for f in found:
            rule = plan_rule(model, report, f, owner, taken)
            if rules and (rule.exponent, rule.folded, rule.source) != (
                rules[0].exponent,
                rules[0].folded,
                rules[0].source,
            ):
                raise NoRule(f"{f.site} and {rules[0].site} need different scales of one block")
            rules.append(rule)
    except NoRule as exc:
        plan.notes.append(f"no exact underflow rule in {owner}: {exc}")
        return False
    except Exception as exc:  # a forward the analysis does not read: the island is always correct
        plan.notes.append(f"no exact underflow rule in {owner}: {type(exc).__name__}: {exc}")
        return False
    if not rules:
        return False
    folded, j = rules[0].folded, rules[0].exponent
    reparams = (
        [
            Reparam(
                folded,
                "linear",
                1.0,
                2.0**-j,
                f"{rules[0].rule}: output x 2^{j}, lifting what FP16 flushed in {owner}",
            )
        ]
        if folded
        else []
    )
    why = _fp32_differs(model, report, rules, reparams)
    if why:
        plan.notes.append(f"no exact underflow rule in {owner}: {why}")
        return False
    plan.underflow_rules += rules
    plan.reparametrized += reparams
    return True


def _fp32_differs(model: nn.Module, report: Report, rules, reparams) -> str:
    """Why the rule is not taken after all: the model rewritten by it alone (on a copy)
    differs in FP32 from the original on inputs like the recorded ones (a path the fx
    analysis did not see); "" when it agrees or nothing could be compared (patch's own
    FP32 check of the whole plan still runs)."""
    from fp16lens.patch._apply import apply_plan  # apply imports the rules: not at import time
    from fp16lens.patch._check import check_equivalent

    try:
        trial = apply_plan(
            copy.deepcopy(model), Plan(reparametrized=list(reparams), underflow_rules=list(rules))
        )
        check_equivalent(model, trial, report)
    except Exception as exc:  # PatchError from the check, or the rewrite failing: the island
        return f"the rewritten block differs in FP32 ({type(exc).__name__}: {str(exc)[:160]})"
    return ""


def _handed_back(report: Report, owner: str) -> list[str]:
    """Sites of module ``owner`` read outside it whose values fall below 2^-24."""

    def inside(site: str) -> bool:
        return _inside(site_module(site), owner)

    out = {p for p, c in report.edges if inside(p) and not inside(c)}
    return sorted(s for s in out if s in report.sites and report.sites[s].underflow)
