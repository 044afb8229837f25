"""watch() on a real detector (torchvision SSDlite, random weights): list-of-images input,
list-of-dicts output, int/bool tensors, non-maximum suppression and box decoding.
Ground truth from real FP16 on the CPU, as for every watch test model."""

from __future__ import annotations

import pytest
import torch

from fp16lens import watch

import models
from torchvision_compat import ensure_torchvision

tv = ensure_torchvision()
pytestmark = pytest.mark.skipif(tv is None, reason="torchvision not installed")


@pytest.fixture(scope="module")
def detector():
    torch.manual_seed(0)
    model = tv.models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=5
    ).eval()
    return model, ([torch.rand(3, 160, 160)],)


def _watched(model, inputs):
    with torch.no_grad():
        ref = model(*inputs)
        with watch(model) as lens:
            out = model(*inputs)
    assert len(out) == len(ref) and all(
        torch.equal(a[k], b[k]) for a, b in zip(out, ref) for k in a
    )
    return lens.report


def test_clean_detector_has_no_span_as_in_real_fp16(detector):
    model, inputs = detector
    assert models.first_inf_site_fp16(model, inputs) is None
    report = _watched(model, inputs)
    assert report.spans == [] and len(report.sites) > 300


def test_overflowing_detector_span_starts_where_real_fp16_first_overflows(detector):
    model, inputs = detector
    conv = model.backbone.features[0][0][0]
    saved = conv.weight.detach().clone()
    try:
        with torch.no_grad():
            conv.weight.mul_(1e6)
        truth = models.first_inf_site_fp16(model, inputs)
        report = _watched(model, inputs)
    finally:
        with torch.no_grad():
            conv.weight.copy_(saved)
    assert truth == ("backbone.features.0.0.0", "convolution")
    assert report.spans and report.spans[0].start == "backbone.features.0.0.0"
