"""The findings of one mechanism (input, internal, parameter, note), each with its fix."""

from __future__ import annotations

import math

from rich.console import RenderableType
from rich.text import Text

from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report._blocks import ViewOptions, fix_line, heading, indent, more, peak_key
from fp16lens.report._model import Finding, Report
from fp16lens.report._triage import trt_consequence

PARAM_LABELS: dict[str, str] = {  # by Finding.kind (a str)
    FindingKind.PARAM_OVERFLOW: "beyond 65504",
    FindingKind.PARAM_SUBNORMAL: "subnormal",
    FindingKind.PARAM_UNDERFLOW: "flushed to zero",
}


def _finding_block(report: Report, f: Finding, label: str) -> list[RenderableType]:
    head = Text.assemble(("• ", "bold"), (label, "bold yellow"), " ", f.detail)
    out: list[RenderableType] = [indent(head, 2)]
    consequence = trt_consequence(f)
    if consequence:
        out.append(indent(Text(consequence, "italic")))
    return [*out, fix_line(report, f)]


def findings(report: Report, view: ViewOptions, mechanism: str) -> list[RenderableType]:
    items = report.findings_by(mechanism)
    if not items:
        return []
    noun, note = _TITLES[mechanism]
    shown = items if view.full else sorted(items, key=lambda f: -peak_key(f.peak))[: view.top]
    out: list[RenderableType] = [heading(f"{noun[0].upper()}{noun[1:]}s ({len(items)})", note)]
    for f in shown:
        out += _finding_block(report, f, _label(f))
    return out + more(len(shown), len(items), noun, view.full_hint)


_TITLES = {  # by mechanism: the noun (singular), a note under the heading
    "input": ("input problem", "in the data, not in the model"),
    "internal": ("internal risk", "inside an op, invisible at its output"),
    "underflow": (
        "underflow problem",
        "values FP16 makes 0 reach a log, a divide or an rsqrt: inf/NaN",
    ),
    "parameter": ("parameter problem", "weights and buffers FP16 cannot hold"),
    "output": ("other output problem", ""),
    "note": ("note", "not overflow today, but worth knowing before TensorRT"),
}


def _label(f: Finding) -> str:
    if f.mechanism == Mechanism.PARAMETER and not math.isfinite(f.peak):
        return f"[inf/NaN ×{f.count}]"
    if f.mechanism == Mechanism.PARAMETER:
        return f"[{PARAM_LABELS.get(f.kind, f.kind)} ×{f.count}]"
    if f.mechanism == Mechanism.NOTE and f.kind in PARAM_LABELS:
        return f"[{PARAM_LABELS[f.kind]} ×{f.count} · harmless]"
    if f.mechanism == Mechanism.UNDERFLOW:
        return f"[{f.site} · {f.count} inf/NaN · {100 * f.peak:.3g}% flushed]"
    what = f.kind if f.mechanism in (Mechanism.INTERNAL, Mechanism.NOTE) else f.kind or f.mechanism
    return f"[{f.site} · {what}]" if f.site else f"[{what}]"  # a note on the whole graph: no site


def orphan_outputs(report: Report, view: ViewOptions) -> list[RenderableType]:
    """Output findings that no span stands for (softmax-exp without a span, ...)."""
    starts = {s.start for s in report.spans}
    orphans = [f for f in report.findings_by(Mechanism.OUTPUT) if f.site not in starts]
    if not orphans:
        return []
    sub = Report(sites=report.sites, findings=orphans, spans=report.spans, meta=report.meta)
    return findings(sub, view, "output")
