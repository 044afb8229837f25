"""``--fail-on`` policies for CI gates: which report contents fail the run (exit 1)."""

from __future__ import annotations

from fp16lens._core.sites import FP16_RUN_FLUSHED, FindingKind, Mechanism
from fp16lens.report import Report

POLICIES = ("overflow", "internal", "parameter", "underflow", "any")
POLICY_HELP = (
    "exit 1 when the report has: overflow (a stored value beyond the FP16 range: a span or "
    "an output/input finding), internal (overflow inside an op, or a span TensorRT fuses "
    "away), parameter (a weight/buffer FP16 cannot hold), underflow (values FP16 flushes to zero "
    "reaching a log, a divide, an rsqrt or a negative power, or the outputs), any (anything at "
    "all, a graph whose real FP16 run fails included); repeatable"
)


def violations(report: Report, policies: list[str] | None) -> list[str]:
    """One line per report item that a chosen policy forbids (empty: the gate passes)."""
    lines: list[str] = []
    for policy in dict.fromkeys(policies or []):
        lines += _check(report, policy)
    return list(dict.fromkeys(lines))


def _check(report: Report, policy: str) -> list[str]:
    lines = []
    for span in report.failing_spans():  # a lower --threshold highlights, never fails
        # a fused span is never stored in FP16 by TensorRT: it is an internal risk
        kind = "internal" if span.fused else "overflow"
        if policy in ("any", kind):
            end = span.end or "the model output"
            lines.append(f"span {span.start} -> {end} (peak {span.peak:.4g})")
    wanted = {
        "overflow": (Mechanism.OUTPUT, Mechanism.INPUT),
        "internal": (Mechanism.INTERNAL,),
        "parameter": (Mechanism.PARAMETER,),
        "underflow": (Mechanism.UNDERFLOW,),
        "any": (
            Mechanism.OUTPUT,
            Mechanism.INPUT,
            Mechanism.INTERNAL,
            Mechanism.PARAMETER,
            Mechanism.UNDERFLOW,
        ),
    }[policy]
    in_spans = {site for span in report.spans for site in span.sites}
    for f in report.findings:
        if f.kind == FindingKind.FP16_RUN:  # no value out of range: flushes, or precision
            if policy == "any" or (policy == "underflow" and f.tensor == FP16_RUN_FLUSHED):
                lines.append(f"fp16-run at {f.site or 'the outputs'} (cosine {f.peak:.4g})")
            continue
        if f.mechanism == Mechanism.OUTPUT and f.site in in_spans:
            continue  # the span above already says it
        if f.mechanism in wanted and not report.margin_finding(f):
            what = (
                f"{f.site}.{f.tensor}"
                if f.tensor and f.mechanism == Mechanism.PARAMETER
                else f.site
            )
            lines.append(f"{f.mechanism} {f.kind or 'finding'} at {what} (peak {f.peak:.4g})")
    return lines
