"""patch()'s contract: preconditions with named errors (model untouched), copies vs
in place, the plan travelling with the model, the check after the rewrite, FP32 islands
surviving .half(), and the plan's rendering."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from rich.console import Console
from torch import nn

import fp16lens
from fp16lens._core import PatchError
from fp16lens.patch import Fp32Island, PatchOptions, get_plan, patch, plan, relative_error
from fp16lens.report import Report, ReportMeta, SiteStats, Span

from models import bn_huge_var, gelu_span, layernorm_on_input, relu_span


def _report(model, inputs):
    with fp16lens.watch(model) as lens, torch.no_grad():
        model(*inputs)
    return lens.report


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def relu_case():
    model, inputs = relu_span()
    return model, inputs, _report(model, inputs)


def _hand_report(edges) -> Report:
    """relu_span's report built by hand (as before watch existed)."""

    def site(name, op, order, absmax):
        return SiteStats(name, "module", op, name, order, calls=1, absmax=absmax)

    sites = [
        site("fc1", "Linear", 0, 3.0e5),
        site("act", "ReLU", 1, 3.0e5),
        site("fc2", "Linear", 2, 50.0),
    ]
    span = Span("fc1", "fc2", 3.0e5, "fc1", ["fc1", "act", "fc2"], ends=["fc2"])
    meta = ReportMeta(model_class="ReluSpan", batches=1, input_shapes=[[[4, 16]]])
    return Report({s.name: s for s in sites}, [span], [], list(edges), meta)


def test_hand_built_report_is_patched_exactly(relu_case):
    model, inputs, _ = relu_case
    patched = patch(model, _hand_report([("fc1", "act"), ("act", "fc2")]))
    assert [(r.module, r.s_in, r.s_out) for r in get_plan(patched).reparametrized] == [
        ("fc1", 1.0, 64.0),
        ("fc2", 64.0, 1.0),
    ]
    with torch.no_grad():  # one power of two folded into each side: bit-exact in FP32
        assert torch.equal(model(*inputs), patched(*inputs))


def test_check_after_rewrite_refuses_a_report_with_wrong_dataflow(relu_case):
    model, _, _ = relu_case
    before = _state(model)
    wrong = _hand_report([("fc1", "act"), ("act", "fc1")])  # hides act -> fc2
    with pytest.raises(PatchError, match="differs from the original"):
        patch(model, wrong, inplace=True)
    assert _same(before, _state(model))


def test_training_mode_is_refused_where_it_changes_the_model():
    model, inputs = bn_huge_var()
    report = _report(model, inputs)
    model.train()  # its batch norm would normalize by the batch's statistics
    with pytest.raises(PatchError, match=r"training mode \(bn\).*model\.eval\(\)"):
        patch(model, report)
    with pytest.raises(PatchError, match="training mode"):
        plan(model, report)


class _Window(nn.Module):
    """torchfcpe's window holder: a buffer and a forward that returns it."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("window", torch.hann_window(n), persistent=False)

    def forward(self):
        return self.window


class _CachesAWindow(nn.Module):
    """relu_span's layers, and a window its forward builds on first use, after .eval():
    a child in training mode whose class never reads the mode (as torchfcpe's mel
    extractor does)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.cache = nn.ModuleDict()

    def forward(self, x):
        if "16" not in self.cache:
            self.cache["16"] = _Window(x.shape[-1])
        return self.inner(x * (1 + self.cache["16"]()))


def test_a_child_the_forward_builds_after_eval_does_not_block_patch(relu_case):
    inner, inputs, _ = relu_case
    model = _CachesAWindow(copy.deepcopy(inner)).eval()
    report = _report(model, inputs)
    assert model.cache["16"].training and not model.inner.training  # built after .eval()
    patched = patch(model, report, batches=[inputs])
    assert get_plan(patched).regions
    with torch.no_grad():
        assert relative_error(model(*inputs), patched(*inputs)) <= 1e-6
        half = copy.deepcopy(patched).half()(inputs[0].half()).float()
    assert torch.isfinite(half).all()


@pytest.mark.parametrize("factor", [0, -8, math.inf, math.nan, 3.0, True])
def test_invalid_factors_are_refused(relu_case, factor):
    model, _, report = relu_case
    before = _state(model)
    with pytest.raises(PatchError, match="factor"):
        patch(model, report, factor=factor, inplace=True)
    assert _same(before, _state(model))


def test_non_power_of_two_factor_when_allowed(relu_case):
    model, inputs, report = relu_case
    patched = patch(model, report, factor=48.0, allow_non_power_of_two=True)
    assert {r.factor for r in get_plan(patched).regions} == {48.0}
    with torch.no_grad():
        assert relative_error(model(*inputs), patched(*inputs)) <= 1e-5  # rounds, a little


def test_report_of_another_model_is_refused(relu_case):
    model, _, _ = relu_case
    other, inputs = bn_huge_var()
    with pytest.raises(PatchError, match="another model"):
        patch(model, _report(other, inputs))


def test_copy_by_default_inplace_on_request(relu_case):
    model, _, report = relu_case
    before = _state(model)
    patched = patch(model, report)
    assert patched is not model and _same(before, _state(model))
    assert get_plan(model) is None and get_plan(patched) is not None
    same = patch(model, report, inplace=True)
    assert same is model and get_plan(model) is not None
    assert _same(_state(patched), _state(model))


def test_options_object_and_keywords_are_exclusive(relu_case):
    model, _, report = relu_case
    assert plan(model, report, options=PatchOptions(factor=16.0)).regions[0].factor == 16.0
    with pytest.raises(PatchError, match="either"):
        plan(model, report, factor=16.0, options=PatchOptions())
    with pytest.raises(PatchError, match="PatchOptions"):
        plan(model, report, bogus=1)


def test_island_keeps_fp32_parameters_through_half_and_moves():
    inner = nn.Linear(4, 4)
    weight = inner.weight.detach().clone()
    island = Fp32Island(inner, in_scale=8.0, out_scale=8.0).eval()
    model = nn.Sequential(nn.Linear(4, 4), island).eval().half()
    assert model[0].weight.dtype == torch.float16
    assert island.module.weight.dtype == torch.float32 and torch.equal(island.module.weight, weight)
    model.to("cpu")
    x = torch.rand(2, 4).half()
    out = model(x)
    assert out.dtype == torch.float16
    with torch.no_grad():
        want = inner(model[0](x).float() * 8.0) / 8.0
    torch.testing.assert_close(out.float(), want, rtol=1e-3, atol=1e-3)


def test_plan_is_printable_with_rich_and_plain_data():
    model, inputs = gelu_span()
    the_plan = plan(model, _report(model, inputs))
    console = Console(width=100, record=True, color_system=None)
    console.print(the_plan)
    text = console.export_text()
    assert "FP32 islands" in text and "act" in text and "fc1" in text
    data = the_plan.to_dict()
    assert data["fp32_modules"] == ["act"] and data["regions"][0]["factor"] == 16.0
    assert repr(the_plan).startswith("Plan(2 regions")


def test_clean_report_changes_nothing():
    model, inputs = relu_span()
    with torch.no_grad():
        model.fc1.weight.div_(1.0e4)
        model.fc1.bias.div_(1.0e4)
    report = _report(model, inputs)
    assert report.clean
    patched = patch(model, report)
    assert not get_plan(patched).changes and _same(_state(model), _state(patched))
    console = Console(width=80, record=True, color_system=None)
    console.print(get_plan(patched))
    assert "nothing to patch" in console.export_text()


def test_islands_are_kept_when_patching_a_patched_model():
    model, inputs = gelu_span()
    patched = patch(model, _report(model, inputs))
    again = patch(patched, _report(patched, inputs))
    assert get_plan(again).fp32_modules == ["act"] and not get_plan(again).changes
    assert isinstance(again.act, Fp32Island) and not isinstance(again.act.module, Fp32Island)
    with torch.no_grad():
        assert relative_error(model(*inputs), copy.deepcopy(again)(*inputs)) <= 1e-6


def test_norm_on_a_model_input_falls_back_to_an_fp32_island():
    model, inputs = layernorm_on_input()
    report = _report(model, inputs)
    assert [(f.site, f.kind) for f in report.findings] == [("norm", "norm-variance")]
    patched = patch(model, report)
    the_plan = get_plan(patched)
    assert the_plan.fp32_modules == ["norm"] and not the_plan.regions
    with torch.no_grad():
        assert torch.equal(model(*inputs), patched(*inputs))


def test_plan_to_dict_is_json():
    import json

    model, inputs = relu_span()
    data = json.loads(json.dumps(plan(model, _report(model, inputs)).to_dict()))
    assert data["regions"][0]["entries"] == ["fc1"] and data["fp32_modules"] == []


def test_the_module_is_callable_as_in_the_design(relu_case):
    import fp16lens.patch as patch_module

    model, inputs, report = relu_case
    patched = patch_module(model, report)  # fp16lens.patch(model, report)
    assert get_plan(patched).regions and patch_module.plan(model, report).regions
    with torch.no_grad():
        assert torch.equal(model(*inputs), patched(*inputs))
