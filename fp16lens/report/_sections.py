"""The verdict and the overflow spans of the terminal view (rich renderables)."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from fp16lens._core.sites import (
    FP16_RUN_FLUSHED,
    FP16_RUN_HALF_FAILS,
    FP16_RUN_SHAPE,
    FindingKind,
    Mechanism,
)
from fp16lens.report import _fmt
from fp16lens.report._blocks import ViewOptions, fix_line, heading, indent, more, peak_key
from fp16lens.report._model import Report, SiteStats, Span
from fp16lens.report._triage import next_step


def _worst_site(report: Report) -> SiteStats | None:
    return min(report.sites.values(), key=lambda s: s.headroom, default=None)


def _verdict_counts(report: Report) -> str:
    parts = [
        _fmt.plural(len(report.failing_spans()), "overflow span"),
        _fmt.plural(len(report.findings_by(Mechanism.INTERNAL)), "internal risk"),
        _fmt.plural(len(report.findings_by(Mechanism.PARAMETER)), "parameter problem"),
    ]
    underflow = report.findings_by(Mechanism.UNDERFLOW)
    if underflow:
        parts.insert(0, _fmt.plural(len(underflow), "underflow problem"))
    run = next((f for f in report.findings if f.kind == FindingKind.FP16_RUN), None)
    if run is not None:  # every value in range, yet real FP16 is off: said first
        parts.insert(0, _fp16_run_words(run))
    inputs = report.findings_by(Mechanism.INPUT)
    if inputs:
        parts.append(_fmt.plural(len(inputs), "input problem"))
    notes = report.findings_by(Mechanism.NOTE)
    if notes:
        parts.append(_fmt.plural(len(notes), "note"))
    margin = len(report.spans) - len(report.failing_spans())
    if margin:
        parts.append(
            f"{_fmt.plural(margin, 'span')} only past the threshold {report.meta.threshold:g}"
        )
    return ", ".join(parts)


def _fp16_run_words(f) -> str:
    """What the verdict's check in real FP16 found, in a few words."""
    if not math.isfinite(f.peak):
        return (
            "cannot run in FP16" if f.tensor == FP16_RUN_HALF_FAILS else "not finite in real FP16"
        )
    if f.tensor == FP16_RUN_SHAPE:
        return "an output's length changes in real FP16"
    what = "values FP16 flushes to 0" if f.tensor == FP16_RUN_FLUSHED else "FP16 precision"
    return f"{what}: cosine {f.peak:.4g} in real FP16"


def verdict(report: Report) -> RenderableType:
    """One line that says clean or how bad, plus the single most important next step."""
    name = report.meta.model_class or "model"
    batches = _fmt.plural(report.meta.batches, "batch", "batches")
    worst = _worst_site(report)
    if worst is None:
        return Text(f"? {name}: no sites recorded; run the model inside fp16lens.watch(model)")
    where = f"worst headroom {_fmt.bits(worst.headroom)} bits at {worst.name}"
    if report.clean:
        notes = report.findings_by(Mechanism.NOTE)
        if any(f.kind == FindingKind.UNCHECKED for f in notes):
            return Text.assemble(
                ("? ", "bold yellow"),
                f"{name}: {len(report.sites)} sites in range over {batches}, but the verdict "
                f"was not checked in real FP16 (see the notes); {where} "
                f"(|x| ≤ {_fmt.value(worst.absmax)})",
            )
        if any(f.kind == FindingKind.UNSCANNED for f in notes):
            return Text.assemble(
                ("? ", "bold yellow"),
                f"{name}: {len(report.sites)} sites in range over {batches}, but not every value "
                f"was scanned (see the notes); {where} (|x| ≤ {_fmt.value(worst.absmax)})",
            )
        margin = len(report.spans)  # spans past a --threshold below 65504, values FP16 holds
        return Text.assemble(
            ("✓ ", "bold green"),
            f"{name} is FP16-safe: {len(report.sites)} sites in range over {batches}; "
            f"{where} (|x| ≤ {_fmt.value(worst.absmax)})",
            (f"; {_fmt.plural(len(notes), 'note')} below" if notes else ""),
            (
                f"; {_fmt.plural(margin, 'span')} past the threshold {report.meta.threshold:g} "
                "(values FP16 holds), shown below"
                if margin
                else ""
            ),
        )
    share = (
        f"{_fmt.value(worst.absmax)} = {_fmt.share_of_limit(worst.absmax)} of 65504"
        if math.isfinite(worst.absmax)
        else "inf/NaN already in FP32"
    )
    lines: list[RenderableType] = [
        indent(  # wrapped with no trailing blank, as every paragraph
            Text.assemble(
                ("✗ ", "bold red"), f"{name}: {_verdict_counts(report)}; {where} ({share})"
            ),
            0,
        ),
        indent(Text.assemble(("Next: ", "bold"), next_step(report)), 2),
    ]
    if report.advice is not None and report.advice.error:
        lines.append(
            indent(
                Text(
                    f"fp16lens.patch could not plan this model ({report.advice.error}): the fixes below are "
                    "worded from the report alone",
                    "yellow",
                ),
                2,
            )
        )
    return Group(*lines)


def span_path(span: Span, keep: int = 9) -> Text:
    """start → inside → ends, the ends marked "(back in range)"; long middles collapse."""
    ends = set(span.ends)
    text = Text()
    names = _fmt.collapse(span.sites, keep)
    for i, name in enumerate(names):
        if i:
            text.append(" → ", "dim")
        if name.startswith("… "):
            text.append(name, "dim")
        elif name in ends:
            text.append(name, "green")
            text.append(" (back in range)", "dim green")
        else:
            text.append(name, "bold red" if name == span.peak_site else "red")
    if span.reaches_output:
        text.append(" → ", "dim")
        text.append("model output (still out of range)", "bold red")
    return text


def _span_head(report: Report, i: int, span: Span) -> Text:
    ratio = span.peak / report.meta.threshold if report.meta.threshold else math.inf
    times = f"{ratio:.1f}× the FP16 max" if math.isfinite(ratio) else "inf/NaN in FP32"
    batches = f"{span.batches}/{report.meta.batches} batches" if report.meta.batches else ""
    fused = " · fused on TensorRT (not stored)" if span.fused else ""
    return Text.assemble(
        (f"{i}. ", "bold"),
        ("peak ", ""),
        (_fmt.value(span.peak), "bold red"),
        f" ({times}) at {span.peak_site} · {len(span.sites)} sites",
        (f" · {batches}" if batches else ""),
        (fused, "yellow"),
    )


def spans(report: Report, view: ViewOptions) -> list[RenderableType]:
    if not report.spans:
        return []
    shown = (
        report.spans
        if view.full
        else sorted(
            sorted(report.spans, key=lambda s: -peak_key(s.peak))[: view.top],
            key=report.spans.index,
        )
    )
    out: list[RenderableType] = [
        heading(
            f"Overflow spans ({len(report.spans)})", f"values stored beyond {_fmt.limit(report)}"
        )
    ]
    for span in shown:
        i = report.spans.index(span) + 1
        out += [
            indent(_span_head(report, i, span), 2),
            indent(span_path(span, view.path_keep)),
            fix_line(report, span),
        ]
    return out + more(len(shown), len(report.spans), "span", view.full_hint)
