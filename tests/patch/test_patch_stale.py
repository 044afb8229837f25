"""A report made from other weights than the model's is refused before anything is patched."""

from __future__ import annotations

import json

import pytest
import torch

from fp16lens import patch, watch
from fp16lens._core import ReportError, StaleReportError
from fp16lens._core.fingerprint import changed, fingerprint
from fp16lens.report import Report

import models


def _watched():
    model, inputs = models.bn_huge_var()
    with torch.no_grad(), watch(model) as lens:
        model(*inputs)
    assert not lens.report.clean  # BN running_var 1e7: patch has something to do
    return model, inputs, lens.report


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_changed_conv_weight_is_refused_and_the_model_is_untouched():
    model, _, report = _watched()
    with torch.no_grad():
        model.conv.weight[0, 0, 0, 0] += 1.0  # same architecture, one weight changed
    before = _state(model)
    for call in (patch.plan, patch.patch):
        with pytest.raises(StaleReportError, match=r"re-run fp16lens\.watch") as err:
            call(model, report)
        assert "conv.weight" in str(err.value) and "bn.running_var" not in str(err.value)
        assert isinstance(err.value, ReportError)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert patch.get_plan(model) is None


def test_permuted_weights_are_a_change():
    model, _, report = _watched()
    with torch.no_grad():
        model.head.weight.copy_(model.head.weight.flip(0))  # same values, other channels
    assert changed(report.meta.weights, model) == ["head.weight"]


def test_unchanged_model_patches_and_so_does_the_report_from_json(tmp_path):
    model, inputs, report = _watched()
    patched = patch.patch(model, report)
    loaded = Report.load(report.save(tmp_path / "r.json"))
    assert loaded.meta.weights == report.meta.weights and "conv.weight" in loaded.meta.weights
    again = patch.patch(model, loaded)
    with torch.no_grad():  # ground truth: real FP16 of both patched models stays finite
        for m in (patched, again):
            out = m.half()(*[t.half() for t in inputs])
            assert torch.isfinite(out).all()


def test_report_without_fingerprint_still_loads_and_patches(tmp_path):
    model, _, report = _watched()
    data = report.to_dict()
    data["schema_version"] = 1  # what fp16lens wrote before fingerprints
    del data["meta"]["weights"]
    data["meta"]["schema_version"] = 1
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    old = Report.load(path)
    assert old.meta.weights == {}
    with torch.no_grad():
        model.conv.weight.mul_(1.5)  # cannot be told: patched as before, without a check
    patch.patch(model, old)


def test_fingerprint_tolerates_reduction_order_but_not_a_real_change():
    model, _, _ = _watched()
    recorded = fingerprint(model)
    nudged = {k: [v[0], *(x * (1 + 1e-12) for x in v[1:])] for k, v in recorded.items()}
    assert changed(nudged, model) == []  # last-bit differences of another device's sums
    with torch.no_grad():
        model.bn.running_var[0] *= 2  # a buffer the ranges depend on
    assert changed(recorded, model) == ["bn.running_var"]


def test_damaged_fingerprint_is_a_report_error():
    _, _, report = _watched()
    data = report.to_dict()
    data["meta"]["weights"]["conv.weight"] = "abc"
    with pytest.raises(ReportError, match="damaged"):
        Report.from_dict(data)
