"""Watching a patched model again finds nothing: islands store FP32 values by design."""

from __future__ import annotations

import copy

import pytest
import torch

from fp16lens import patch, watch

import models


@pytest.mark.parametrize("name", ["gelu_span", "seed_case", "bn_huge_var"])
def test_patched_model_watches_clean(name):
    model, inputs = models.WATCH_CASES[name]()
    with torch.no_grad(), watch(model) as lens:
        model(*inputs)
    assert not lens.report.clean
    patched = patch.patch(model, lens.report)
    with torch.no_grad(), watch(patched) as again:
        patched(*inputs)
    assert again.report.spans == []
    assert again.report.findings_by("parameter") == []
    half = copy.deepcopy(patched).half()
    with torch.no_grad():
        out = half(*[t.half() for t in inputs])
    assert torch.isfinite(out).all()


def test_functional_op_inside_a_module_falls_back_to_an_island_on_that_module():
    model, inputs = models.block_mul()
    with torch.no_grad(), watch(model) as lens:
        ref = model(*inputs)
    assert lens.report.spans[0].start == "act:mul"
    with torch.no_grad():  # real FP16 breaks there
        assert not torch.isfinite(copy.deepcopy(model).half()(inputs[0].half())).all()
    plan = patch.plan(model, lens.report)
    assert [i.module for i in plan.islands] == ["act"] and not plan.unresolved
    patched = patch.patch(model, lens.report)
    with torch.no_grad():
        out = copy.deepcopy(patched).half()(inputs[0].half()).float()
        assert torch.equal(patched(*inputs), ref)
    assert torch.isfinite(out).all()
    assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.999


def test_island_passes_attribute_reads_to_the_wrapped_module():
    from fp16lens.patch import Fp32Island

    bn = torch.nn.BatchNorm2d(4)
    island = Fp32Island(bn)
    assert island.weight is bn.weight and island.num_features == 4
    half = copy.deepcopy(island).half()
    assert half.weight.dtype == torch.float32  # stays FP32 under .half()
    with pytest.raises(AttributeError):
        island.no_such_attribute
