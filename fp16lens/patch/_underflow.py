"""The fix for underflow findings (mechanism ``underflow``): one FP32 island covering the
normalization block, from the site where the values flush through the op where their
zeros become non-finite.

The island is the smallest module whose forward runs both (their common ancestor in the
module tree): inside it nothing is stored in FP16, so the small values keep their FP32
magnitude until the log or the divide has turned them into ordinary numbers. It is always
correct; an exact power-of-two rescaling of the flushing region (log turns 2^k into an
additive k·log 2, a ratio of equally scaled operands cancels it) would keep more of the
model in FP16 and is left to a later rule. A block whose common ancestor is the model
itself cannot be an island: it stays unresolved with that reason.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from fp16lens._core.sites import Mechanism, site_module
from fp16lens.patch._plan import Island, Plan, Unresolved
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
    return name == outer or name.startswith(outer + ".")


def underflow_islands(model: nn.Module | None, report: Report, plan: Plan) -> None:
    """Add to ``plan`` one FP32 island per underflow block (merged when one holds another)."""
    if model is None:
        return
    wanted: dict[str, list[str]] = {}
    for f in report.findings:
        if f.mechanism != Mechanism.UNDERFLOW:
            continue
        origin = f.tensor if f.tensor in report.sites else f.site
        owner = _common(site_module(origin), site_module(f.site))
        if not owner:
            plan.unresolved.append(Unresolved(f.site, (
                f"underflow at {f.site} (values flushed at {origin}): the block from {origin} to "
                f"{f.site} runs in the model's own forward, which cannot be an FP32 island; move "
                "it into a submodule (then patch keeps that one in FP32) or keep the model in FP32")))
            continue
        wanted.setdefault(owner, []).append(f"underflow: {f.site} ({f.count} non-finite, values flushed at {origin})")
    taken = [i.module for i in [*plan.kept, *plan.islands]]
    for owner in sorted(wanted, key=len):
        if any(_inside(owner, t) for t in taken):  # already FP32 inside an island: say so
            at = next((k for k, i in enumerate(plan.islands) if _inside(owner, i.module)), None)
            if at is not None:
                isl = plan.islands[at]
                plan.islands[at] = dataclasses.replace(isl, reason=f"{isl.reason}; also fixes "
                                                       + "; ".join(wanted[owner]))
            continue
        if any(_inside(t, owner) for t in taken):
            plan.notes.append(f"underflow island {owner} holds another island: left to that one")
            continue
        try:
            model.get_submodule(owner)
        except AttributeError:
            continue
        plan.islands.append(Island(owner, 1.0, 1.0, "; ".join(wanted[owner]) + " (rule: FP32 island of the block)"))
        taken.append(owner)
        handed = _handed_back(report, owner)
        if handed:
            plan.notes.append(
                f"the FP32 island {owner} hands back values below 2^-24 that FP16 makes 0 "
                f"({', '.join(handed[:3])}): harmless unless a log or divide outside reads them "
                "(a scan of the patched model says)")


def _handed_back(report: Report, owner: str) -> list[str]:
    """Sites of module ``owner`` read outside it whose values fall below 2^-24."""
    def inside(site: str) -> bool:
        return _inside(site_module(site), owner)

    out = {p for p, c in report.edges if inside(p) and not inside(c)}
    return sorted(s for s in out if s in report.sites and report.sites[s].underflow)
