"""A parameter loss judged harmless is a note: the verdict stays ✓, the note says why."""

from __future__ import annotations

import dataclasses

from test_report_golden import render_plain

from fp16lens.report import Finding
from fp16lens.report._advice import suggest_fix
from fp16lens.report._triage import next_step

import sample_reports as samples


def _tiny_bias(mechanism: str) -> Finding:
    return Finding(
        site="features.1",
        mechanism=mechanism,
        kind="param-underflow",
        peak=1e-9,
        tensor="bias",
        count=8,
        detail="features.1.bias: 8 of 8 non-zero values are below 2^-24 and become 0 in FP16 "
        "(100% of the tensor's magnitude); harmless: a change of ≤ 1e-08 per value, below half "
        "an FP16 step (0.00049) of the values it joins at features.1 (typical |y| ≈ 1)",
    )


def test_harmless_parameter_loss_keeps_the_verdict_clean():
    report = samples.clean_report()
    report.findings.append(_tiny_bias("note"))
    text = render_plain(report)
    assert report.clean and text.startswith("✓ CleanNet is FP16-safe") and "1 note below" in text
    assert "[flushed to zero ×8 · harmless] features.1.bias" in text
    assert "Parameter problems" not in text and next_step(report) == ""
    assert suggest_fix(report, report.findings[0]).startswith("none: what features.1.bias loses")


def test_visible_parameter_loss_is_a_problem():
    report = samples.clean_report()
    report.findings.append(dataclasses.replace(_tiny_bias("parameter"), detail="... visible"))
    text = render_plain(report)
    assert not report.clean and text.startswith(
        "✗ CleanNet: 0 overflow spans, 0 internal risks, 1 parameter problem"
    )
    assert "Parameter problems (1)" in text


def test_root_module_parameter_is_named_without_a_leading_dot():
    report = samples.clean_report()
    report.findings.append(dataclasses.replace(_tiny_bias("parameter"), site="", tensor="gamma"))
    fix = suggest_fix(report, report.findings[0])
    assert (
        fix.startswith("8 values of gamma become 0")
        and "keep the root module's own ops in FP32" in fix
    )
    assert next_step(report).endswith("— gamma below")
