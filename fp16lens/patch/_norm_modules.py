"""Modules recognized by what they compute, seen by the planner as one module site.

watch records the functional ops of a module that is not a built-in leaf (timm's
BatchNormAct2d: ``bn1:batch_norm``; a FrozenBatchNorm2d: ``bn1:rsqrt``, ``bn1:mul``, ...).
Where ``fused_kind`` recognizes the module as a batch norm or an invariant norm, its own
functional ops become one site named after the module (its child modules, an activation,
stay sites of their own), so the planner rescales and re-parametrizes it like a built-in.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from fp16lens._core.algebra import fused_kind
from fp16lens.report import Report


def contract(model: nn.Module, report: Report) -> Report:
    """``report`` with each recognized module's own functional ops merged into one site;
    ``report`` itself when there is none."""
    units = _units(model, report)
    if not units:
        return report
    rename = {
        s: st.module for s, st in report.sites.items() if st.kind == "op" and st.module in units
    }
    sites, edges = merge_sites(
        report,
        rename,
        lambda unit: dataclasses.replace(
            _output_site(report, unit, rename),
            name=unit,
            kind="module",
            op=type(units[unit]).__name__,
            module=unit,
        ),
    )
    return dataclasses.replace(
        report,
        sites=sites,
        edges=edges,
        spans=[rename_span(sp, rename) for sp in report.spans],
        findings=[dataclasses.replace(f, site=rename.get(f.site, f.site)) for f in report.findings],
    )


def merge_sites(report: Report, rename: dict[str, str], unit_site) -> tuple[dict, list]:
    """``report``'s sites and edges with the sites in ``rename`` merged into their unit
    (``unit_site(unit)``: the unit's one site), self-edges dropped."""
    edges = list(dict.fromkeys(
        (rename.get(p, p), rename.get(c, c)) for p, c in report.edges if rename.get(p, p) != rename.get(c, c)
    ))  # fmt: skip
    sites = {}
    for name, st in report.sites.items():
        unit = rename.get(name)
        if unit is None:
            sites[name] = st
        elif unit not in sites:
            sites[unit] = unit_site(unit)
    return sites, edges


def _units(model: nn.Module, report: Report) -> dict[str, nn.Module]:
    """Modules with functional sites of their own that compute a batch norm or a norm, and
    whose own ops are not interleaved with their children's (no cycle once merged)."""
    named = dict(model.named_modules())
    owners = {st.module for st in report.sites.values() if st.kind == "op" and st.module}
    units = {o: named[o] for o in owners if o in named and fused_kind(named[o]) is not None}
    for unit in list(units):
        own = {s for s, st in report.sites.items() if st.kind == "op" and st.module == unit}
        into = {p for p, c in report.edges if c in own and p not in own}
        out_of = {c for p, c in report.edges if p in own and c not in own}
        if into & out_of:
            del units[unit]
    return units


def _output_site(report: Report, unit: str, rename: dict[str, str]):
    """The unit's site whose value leaves it (to a consumer outside, or as the model's
    output: the last one executed)."""
    own = [s for s in report.sites if rename.get(s) == unit]
    leaving = [p for p, c in report.edges if rename.get(p) == unit and rename.get(c) != unit]
    consumed = {p for p, c in report.edges if rename.get(p) == unit and rename.get(c) == unit}
    last = [s for s in own if s not in consumed]
    return report.sites[(leaving or last or own)[-1]]


def rename_span(span, rename: dict[str, str]):
    def r(s):
        return rename.get(s, s)

    return dataclasses.replace(
        span,
        start=r(span.start),
        end=None if span.end is None else r(span.end),
        peak_site=r(span.peak_site),
        sites=list(dict.fromkeys(r(s) for s in span.sites)),
        ends=list(dict.fromkeys(r(s) for s in span.ends)),
    )
