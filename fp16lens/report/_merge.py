"""Merge reports of the same model: several runs, or several torch.distributed ranks."""

from __future__ import annotations

import copy
import math

from fp16lens._core import ReportError
from fp16lens._core.sites import Mechanism
from fp16lens.report._model import Finding, Report, SiteStats, Span


def _bigger(a: float, b: float) -> bool:
    return (not math.isnan(b)) and (math.isnan(a) or a > b)


def _merge_site(into: SiteStats, s: SiteStats, batch_offset: int) -> None:
    if _bigger(s.absmax, into.absmax):
        into.absmax, into.absmax_batch = s.absmax, s.absmax_batch + batch_offset
    for f in ("calls", "numel", "zeros", "nonfinite", "overflow", "subnormal", "underflow"):
        setattr(into, f, getattr(into, f) + getattr(s, f))
    into.hist = [a + b for a, b in zip(into.hist, s.hist)]


def _merge_span(into: Span, s: Span, order: dict[str, int], batch_offset: int) -> None:
    if _bigger(s.peak, into.peak):
        into.peak, into.peak_site = s.peak, s.peak_site
    into.sites = sorted(set(into.sites) | set(s.sites), key=lambda n: order.get(n, 1 << 30))
    into.ends = sorted(set(into.ends) | set(s.ends), key=lambda n: order.get(n, 1 << 30))
    into.reaches_output |= s.reaches_output
    into.end = None if into.reaches_output else (into.ends[0] if into.ends else None)
    into.batches += s.batches
    into.fused &= s.fused
    if into.first_batch < 0:
        into.first_batch = s.first_batch + batch_offset


def _finding_key(f: Finding) -> tuple:
    return (f.site, f.mechanism, f.kind, f.tensor)


def merge_reports(reports: list[Report]) -> Report:
    """One report from several of the same model: maxima, counts and spans combined."""
    if not reports:
        raise ReportError("merge_reports needs at least one report")
    first = reports[0]
    for r in reports[1:]:
        if r.meta.model_class != first.meta.model_class or r.meta.threshold != first.meta.threshold:
            raise ReportError(
                f"cannot merge a report of {r.meta.model_class} (threshold {r.meta.threshold:g}) "
                f"into one of {first.meta.model_class} (threshold {first.meta.threshold:g}); "
                "merge only reports of the same model taken with the same threshold"
            )
    out = copy.deepcopy(first)
    offset = first.meta.batches
    for r in reports[1:]:
        for name, s in r.sites.items():
            if name in out.sites:
                _merge_site(out.sites[name], s, offset)
            else:
                new = copy.deepcopy(s)
                new.absmax_batch += offset
                new.order = len(out.sites)
                out.sites[name] = new
        order = {n: s.order for n, s in out.sites.items()}
        spans = {sp.start: sp for sp in out.spans}
        for sp in r.spans:
            if sp.start in spans:
                _merge_span(spans[sp.start], sp, order, offset)
            else:
                spans[sp.start] = copy.deepcopy(sp)
        out.spans = sorted(spans.values(), key=lambda sp: order.get(sp.start, 1 << 30))
        found = {_finding_key(f): f for f in out.findings}
        for f in r.findings:
            cur = found.get(_finding_key(f))
            if cur is not None and f.mechanism == Mechanism.UNDERFLOW:  # counts over all ranks
                cur.count += f.count
                cur.peak = max(cur.peak, f.peak)
            elif cur is None or _bigger(f.peak, cur.peak):
                found[_finding_key(f)] = copy.deepcopy(f)
        out.findings = list(found.values())
        out.edges = sorted(set(out.edges) | set(r.edges))
        out.meta.input_shapes += [s for s in r.meta.input_shapes if s not in out.meta.input_shapes]
        _merge_inputs(out.meta.inputs, r.meta.inputs)
        out.meta.batches += r.meta.batches
        offset += r.meta.batches
    return out


def _merge_inputs(into: list[dict], more: list[dict]) -> None:
    """Each input's recorded range widened by another report's (same name and dtype)."""
    by_name = {e["name"]: e for e in into}
    for e in more:
        cur = by_name.get(e["name"])
        if cur is None:
            into.append(copy.deepcopy(e))
        elif cur.get("dtype") == e.get("dtype") and "min" in e and "max" in e:
            cur["min"], cur["max"] = min(cur["min"], e["min"]), max(cur["max"], e["max"])
