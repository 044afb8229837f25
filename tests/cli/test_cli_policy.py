"""--fail-on policies on hand-built reports: which report contents fail a CI gate."""

from __future__ import annotations

import pytest

from fp16lens.cli._policy import violations
from fp16lens.report import Finding, Report, Span


def _report(*, stored=False, fused=False, internal=False, parameter=False) -> Report:
    r = Report()
    if stored:
        r.spans.append(Span("a.bn", "b.bn", 1e5, "a.bn", ["a.bn", "b.bn"], ["b.bn"]))
        r.findings.append(Finding("a.bn", "output", 1e5, "leaves range", kind="overflow"))
    if fused:
        r.spans.append(
            Span("c.conv", "c.bn", 7e4, "c.conv", ["c.conv", "c.bn"], ["c.bn"], fused=True)
        )
    if internal:
        r.findings.append(
            Finding("ln", "internal", 9e4, "(x-mean)^2 overflows", kind="norm-variance")
        )
    if parameter:
        r.findings.append(
            Finding("bn", "parameter", 1e9, "var", kind="param-overflow", tensor="running_var")
        )
    return r


@pytest.mark.parametrize(
    ("contents", "policy", "fails"),
    [
        ({}, "any", False),
        ({"stored": True}, "overflow", True),
        ({"stored": True}, "internal", False),
        ({"fused": True}, "overflow", False),  # TensorRT never stores a fused pre-activation
        ({"fused": True}, "internal", True),
        ({"internal": True}, "internal", True),
        ({"internal": True}, "overflow", False),
        ({"parameter": True}, "parameter", True),
        ({"parameter": True}, "overflow", False),
        ({"parameter": True}, "any", True),
        ({"fused": True}, "any", True),
    ],
)
def test_policies(contents, policy, fails):
    assert bool(violations(_report(**contents), [policy])) is fails


def test_an_output_finding_outside_any_span_counts_as_overflow():
    report = _report()
    report.findings.append(Finding("head", "output", 7e4, "reaches the output", kind="overflow"))
    assert violations(report, ["overflow"]) == ["output overflow at head (peak 7e+04)"]


def test_violation_lines_name_the_site_and_several_policies_combine():
    report = _report(stored=True, parameter=True)
    lines = violations(report, ["overflow", "parameter", "overflow"])
    assert lines == [
        "span a.bn -> b.bn (peak 1e+05)",
        "parameter param-overflow at bn.running_var (peak 1e+09)",
    ]
    assert violations(report, None) == []
