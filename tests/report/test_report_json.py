"""JSON round trip: save then load gives the same report, inf and NaN peaks included."""

from __future__ import annotations

import json
import math

import pytest

from fp16lens.report import Report

import sample_reports as samples


@pytest.mark.parametrize(
    "build", [samples.seed_report, samples.clean_report, samples.long_span_report]
)
def test_round_trip_is_equal(tmp_path, build):
    report = build()
    assert Report.load(report.save(tmp_path / "r.json")) == report


def test_round_trip_keeps_inf_peaks_and_every_finding_kind(tmp_path):
    report = samples.all_kinds_report()
    report.findings = [f for f in report.findings if not math.isnan(f.peak)]
    loaded = Report.load(report.save(tmp_path / "r.json"))
    assert loaded == report
    assert {f.kind for f in loaded.findings} >= {
        "overflow",
        "softmax-exp",
        "nonfinite",
        "norm-variance",
        "rms-square",
        "sum-before-mean",
        "sum-of-squares",
        "param-overflow",
        "param-subnormal",
        "param-underflow",
    }
    assert math.isinf(loaded.sites["attn:exp"].absmax) and math.isinf(loaded.spans[3].peak)


def test_round_trip_keeps_nan_peaks(tmp_path):
    report = samples.all_kinds_report()
    loaded = Report.load(report.save(tmp_path / "r.json"))
    nan_sites = [f.site for f in loaded.findings if math.isnan(f.peak)]
    assert nan_sites == ["head.conv", "input[0]"]
    assert loaded.to_json() == report.to_json()


def test_round_trip_with_nan_peaks_is_equal(tmp_path):
    report = samples.all_kinds_report()
    assert Report.load(report.save(tmp_path / "r.json")) == report
    other = samples.all_kinds_report()
    other.findings[0].peak += 1
    assert other != report  # equality is not vacuous


def test_big_report_round_trip(tmp_path):
    report = samples.big_report(2_000)
    path = report.save(tmp_path / "big.json")
    assert len(json.loads(path.read_text())["sites"]) == 2_000
    assert Report.load(path) == report
