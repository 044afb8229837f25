"""suggest_fix: which fix each problem gets, and the op classes that decide it."""

from __future__ import annotations

import pytest

from fp16lens._core.algebra import OpClass, op_class
from fp16lens.report._advice import headline, suggest_fix
from fp16lens.report._spanfix import plan_span, rescale_exponent, side_inputs
from fp16lens.report._triage import next_step, trt_consequence

import sample_reports as samples


def _finding(report, site, kind):
    return next(f for f in report.findings if f.site == site and f.kind == kind)


@pytest.mark.parametrize(
    ("op", "cls"),
    [
        ("Conv2d", OpClass.ABSORBING),
        ("convolution", OpClass.ABSORBING),
        ("Linear", OpClass.ABSORBING),
        ("addmm", OpClass.ABSORBING),
        ("BatchNorm2d", OpClass.ABSORBING),
        ("ConvTranspose2d", OpClass.ABSORBING),
        ("ReLU", OpClass.HOMOGENEOUS),
        ("relu_", OpClass.HOMOGENEOUS),
        ("LeakyReLU", OpClass.HOMOGENEOUS),
        ("MaxPool2d", OpClass.HOMOGENEOUS),
        ("adaptive_avg_pool2d", OpClass.HOMOGENEOUS),
        ("add", OpClass.HOMOGENEOUS),
        ("cat", OpClass.HOMOGENEOUS),
        ("upsample_nearest2d", OpClass.HOMOGENEOUS),
        ("Upsample", OpClass.HOMOGENEOUS),
        ("Identity", OpClass.HOMOGENEOUS),
        ("LayerNorm", OpClass.INVARIANT),
        ("group_norm", OpClass.INVARIANT),
        ("RMSNorm", OpClass.INVARIANT),
        ("GELU", OpClass.BLOCKING),
        ("sigmoid", OpClass.BLOCKING),
        ("tanh", OpClass.BLOCKING),
        ("SiLU", OpClass.BLOCKING),
        ("exp", OpClass.BLOCKING),
        ("softmax", OpClass.BLOCKING),
        ("pow", OpClass.HOMOGENEOUS),
        ("ReLU6", OpClass.BLOCKING),
        ("hardtanh", OpClass.BLOCKING),
        ("mul", OpClass.BLOCKING),
        ("MyBlock", OpClass.BLOCKING),
    ],
)
def test_op_classes_follow_the_rescaling_algebra(op, cls):
    assert op_class(op) == cls


def test_rescale_exponent_lands_the_peak_near_2_pow_13():
    assert rescale_exponent(271955.25) == 6  # log2(271955 / 8192) = 5.05
    assert rescale_exponent(65505.0) == 3
    assert rescale_exponent(2.53e6, power=2) == 5  # (x-mean)^2 / 4^5 = 2470 < 8192
    assert rescale_exponent(float("inf")) is None and rescale_exponent(float("nan")) is None


def test_seed_span_is_rescaled_with_its_side_input():
    report = samples.seed_report()
    span = report.spans[0]
    plan = plan_span(report, span)
    assert plan.problem == "" and plan.entries == ("backbone.layer4.1.bn2",)
    assert plan.exits == ("neck.reduce_c5.1",) and plan.inner == ("neck.reduce_c5.0",)
    assert side_inputs(report, span) == [("backbone.layer4.0.relu", "backbone.layer4.1:add")]
    fix = suggest_fix(report, span)
    assert fix.startswith(
        "rescale by 2^-6 folded into backbone.layer4.1.bn2 parameters "
        "(k = ceil(log2(2.72e5 / 2^13)) = 6"
    )
    assert "undone by 2^6 in neck.reduce_c5.1" in fix
    assert "the other input of backbone.layer4.1:add (from backbone.layer4.0.relu)" in fix


def test_blocking_modules_become_scaled_islands_inside_the_rescale():
    report = samples.all_kinds_report()
    gelu = report.spans[0]
    plan = plan_span(report, gelu)
    assert plan.islands == ("enc.act",) and plan.entries == ("enc.fc1",)
    assert plan.exits == ("enc.fc2",)
    fix = suggest_fix(report, gelu)
    assert fix.startswith(
        "FP32 island around enc.act (GELU), inside a rescale by 2^-4 folded into enc.fc1 "
        "parameters (k = ceil(log2(7.65e4 / 2^13)) = 4"
    )
    assert "enc.act cannot carry a scale, so each computes in FP32 on its input·2^4" in fix


def test_functional_blockers_and_model_outputs_need_an_island_by_hand():
    report = samples.all_kinds_report()
    _, fused, to_output, broken = report.spans
    assert plan_span(report, to_output).problem == "the values reach the model output out of range"
    assert "keep the model output in FP32" in suggest_fix(report, to_output)
    assert "never stored in FP16" in suggest_fix(report, fused)
    assert suggest_fix(report, broken).startswith("fix the model at :log first")
    mul = samples.seed_report()
    mul.sites["backbone.layer4.1:add"].op = "mul"  # x * y: no scale passes a product
    fix = suggest_fix(mul, mul.spans[0])
    assert fix.startswith("FP32 island around backbone.layer4.1:add (mul): functional ops")
    assert "keep backbone.layer4.1 in FP32 at export (fp32_modules)" in fix


def test_a_homogeneous_start_moves_the_entry_to_its_producers():
    report = samples.seed_report()
    span = report.spans[0]
    span.sites.remove(span.start)
    span.start = "backbone.layer4.1:add"  # bn2 in range, the sum overflows
    # The shortcut comes from a ReLU whose input is a model input: no region.
    assert plan_span(report, span).problem == (
        "backbone.layer4.0.relu takes a model input, which carries no scale"
    )
    report.edges.append(("backbone.layer4.1.conv1", "backbone.layer4.0.relu"))
    plan = plan_span(report, span)
    assert plan.problem == ""  # up through the ReLU to a conv: both convs absorb 2^-k
    assert plan.entries == ("backbone.layer4.1.bn2", "backbone.layer4.1.conv1")
    assert suggest_fix(report, span).startswith(
        "rescale by 2^-6 folded into backbone.layer4.1.bn2, backbone.layer4.1.conv1 parameters"
    )


def test_findings_get_the_fix_of_their_mechanism():
    report = samples.all_kinds_report()
    bn = suggest_fix(report, _finding(report, "enc.bn", "param-overflow"))
    assert bn.startswith("exact affine re-parametrization of enc.bn")
    ln = suggest_fix(report, _finding(report, "enc.norm", "norm-variance"))
    assert ln.startswith("keep LayerNorm as one node (opset ≥ 17) or rescale its input by 2^-5")
    assert "(opset ≥ 18)" in suggest_fix(report, _finding(report, "enc.gn", "norm-variance"))
    pool = suggest_fix(report, _finding(report, "pool", "sum-before-mean"))
    assert pool.startswith("rescale the input by 2^-4") and pool.endswith("keep the pool in FP32")
    sub = suggest_fix(report, _finding(report, "enc.fc2", "param-subnormal"))
    assert "200 values of enc.fc2.weight keep fewer significant bits" in sub
    assert "relative error up to 0.00298" in sub  # 2^-25 / 1e-5
    under = suggest_fix(report, _finding(report, "enc.fc1", "param-underflow"))
    assert "become 0 in FP16" in under
    data = suggest_fix(report, _finding(report, "input[0]", "nonfinite"))
    assert data.startswith("drop or repair the samples holding inf/NaN (batch 1)")


def test_a_fix_written_by_the_watcher_wins_in_the_view():
    report = samples.seed_report()
    report.findings[1].fix = "custom advice"
    assert next_step(report).startswith("rescale by 2^-6")  # the span ranks first
    report.spans = []
    assert next_step(report) == "custom advice — neck.reduce_c5.1 below"


def test_internal_risks_say_what_happens_on_tensorrt():
    report = samples.all_kinds_report()
    for f in report.findings_by("internal"):
        assert trt_consequence(f).startswith("On TensorRT: ")
    assert trt_consequence(report.findings_by("parameter")[0]) == ""


def test_headline_is_the_first_clause():
    assert headline("FP32 island around a → b: why, so how") == "FP32 island around a → b"
    assert headline("rescale by 2^-6 folded into x parameters (k = ceil(..)) = 6") == (
        "rescale by 2^-6 folded into x parameters"
    )
    # a clause inside parentheses is not the end of the first one: the parenthesis stays whole
    words = "patch: Pow_5 re-parametrized (norm: eps / 4096); FP32 island a"
    assert headline(words) == "patch: Pow_5 re-parametrized (norm: eps / 4096)"
    # where patch does nothing, the first step by hand
    words = "patch plans nothing for it; by hand: keep square in FP32 (export(...)); or that"
    assert headline(words) == "by hand: keep square in FP32 (export(...))"
