"""patch() through squeeze-excitation products x * gate(pool(x)), judged by real FP16 on
CPU (``copy.deepcopy(m).half()``): x carries 1/p, the pool passes it, the gate's first
conv takes p back (the gate is unscaled) and the product carries x's 1/p to the next
exit. No FP32 island, no multiply; FP32 unchanged, FP16 finite and close to FP32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16lens._core.algebra import KIND_CLASS, OpClass, product_carrier
from fp16lens.patch import get_plan, patch, relative_error
from fp16lens.patch._graph import build_graph
from fp16lens.report._spanfix import _cls as report_class

from models import _plant_bn, _seeded, mobilenet_v3_shaped, squeeze_excite
from plant import assert_fixed, watch_report


def _fixed(model, inputs):
    """The planted overflow is fixed (``plant.assert_fixed``)."""
    return assert_fixed(model, inputs)


@pytest.mark.parametrize("gate", ["sigmoid", "hardsigmoid"])
def test_torchvision_squeeze_excitation_is_rescaled_through_its_product(gate):
    model, inputs = squeeze_excite(gate)
    the_plan, _ = _fixed(model, inputs)
    assert not the_plan.islands and not the_plan.unresolved and not the_plan.multiplies
    [region] = the_plan.regions
    assert "se:mul" in region.sites and "se.avgpool" in region.sites
    assert region.entries == ("bn",)
    assert set(region.exits) == {"se.fc1", "out"}  # the gate's first conv takes p back
    scales = {r.module: (r.s_in, r.s_out) for r in the_plan.reparametrized}
    assert scales["se.fc1"] == (region.factor, 1.0) and scales["out"] == (region.factor, 1.0)
    assert "se.fc2" not in scales  # the gate itself is unscaled


def test_mobilenet_v3_inverted_residual_with_se_and_hardswish():
    model, inputs = mobilenet_v3_shaped()
    the_plan, _ = _fixed(model, inputs)
    assert not the_plan.islands and not the_plan.unresolved and not the_plan.multiplies
    [region] = the_plan.regions
    assert "re.block.2:mul" in region.sites
    assert set(region.exits) == {"re.block.2.fc1", "re.block.3.0"}


def test_report_advice_agrees_with_patch_on_the_product():
    model, inputs = squeeze_excite("hardsigmoid")
    report = watch_report(model, inputs)
    graph = build_graph(model, report)
    assert graph.carries == {"se:mul": "act"}
    assert (
        report_class(report, "se:mul") == KIND_CLASS[graph.kinds["se:mul"]] == OpClass.HOMOGENEOUS
    )


def test_product_carrier_is_the_operand_the_other_is_computed_from():
    producers = {
        "mul": ["gate", "x"],
        "gate": ["fc2"],
        "fc2": ["fc1"],
        "fc1": ["pool"],
        "pool": ["x"],
    }
    assert product_carrier("mul", producers) == "x"
    assert product_carrier("mul", {"mul": ["a", "b"], "a": ["in"], "b": ["in"]}) is None  # siblings
    assert product_carrier("mul", {"mul": ["a"], "a": ["in"]}) is None  # x * x or x * constant


class SquareGate(nn.Module):
    """x * relu(x): the "gate" is homogeneous in x, so the product would carry x's scale
    twice (p^2): the product stays opaque."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.out(y * self.act(y) / 65536.0)


@torch.no_grad()
def test_a_product_of_one_scale_with_itself_gets_no_region():
    _seeded(17)
    model, inputs = SquareGate().eval(), (torch.rand(2, 3, 8, 8),)
    _plant_bn(model, inputs, model.bn, target=2 * 65504.0)
    patched = patch(model, watch_report(model, inputs))
    the_plan = get_plan(patched)
    assert not any(":mul" in s for r in the_plan.regions for s in r.sites)
    why = [u.reason for u in the_plan.unresolved]  # an opaque product, as without the rule
    assert any(":mul, a consumer of bn, does not pass a scale" in w for w in why), why
    assert relative_error(model(*inputs), patched(*inputs)) <= 1e-6
