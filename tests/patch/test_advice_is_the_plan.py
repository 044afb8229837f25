"""One plan (issue 25): the report's advice is what fp16lens.patch does.

For every model of the suite that has a problem, the report watch makes holds patch's plan
(``report.advice``), and that plan is the one ``fp16lens.patch`` applies (``get_plan`` of
the patched model). The words each span and finding shows name exactly the plan's factors,
islands and unresolved sites: no factor the plan does not use, no island it does not make,
no problem the plan leaves out without saying so. The plan travels through the report's
JSON and renders without the model.
"""

from __future__ import annotations

import io
import math
import re
import warnings

import pytest
import torch
from rich.console import Console

import fp16lens
from fp16lens._core.sites import Mechanism
from fp16lens.patch._advise import advice_of
from fp16lens.report import Report

import models

BUILDERS = {
    name: getattr(models, name)
    for name in (
        "seed_case",
        "functional_mul",
        "layernorm_variance",
        "avgpool_sum",
        "bn_huge_var",
        "gelu_span",
        "rmsnorm_square",
        "relu_span",
        "gated_sum",
        "layernorm_on_input",
        "block_mul",
        "attention_span",
        "masked_softmax",
        "squeeze_excite",
        "mobilenet_v3_shaped",
        "shared_weight",
        "huge_weight_head",
        "act_span",
        "hardswish_stem",
        "exp_log",
        "stft_log",
        "embedding_output",
        "lstm_raw_input",
        "raw_conv_input",
        "silu_pair",
        "sdpa_attention",
        "rms_norm_head",
        "magnitude",
        "layer_scale_readout",
        "clean",
        "multi_output",
    )
}
CLEAN = {"clean", "multi_output", "masked_softmax"}  # notes only


def _watched(name: str):
    model, inputs = BUILDERS[name]()
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(*inputs)
    return model, inputs, lens.report


def _words(report: Report) -> str:
    fixes = [s.fix for s in report.spans]
    fixes += [f.fix for f in report.findings if f.mechanism != Mechanism.NOTE]
    return " | ".join(fixes)


def _k(factor: float) -> str:
    return str(round(math.log2(factor)))


@pytest.mark.parametrize("name", BUILDERS)
def test_the_advice_is_the_plan_patch_applies(name):
    model, _, report = _watched(name)
    if name in CLEAN:  # the controls: clean in real FP16 on every torch release
        assert report.clean
    if report.clean:  # nothing to fix, nothing planned (on older torch releases, where the
        assert report.advice is None  # .half() upcast trace differs, rmsnorm_square has a plan)
        return
    assert report.advice is not None and report.advice.error == ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp16lens.PatchWarning)
        patched = fp16lens.patch(model, report)
    plan = fp16lens.patch.get_plan(patched)
    assert report.advice == advice_of(plan)  # the action is the advice, entry for entry

    words = _words(report)
    assert "patch plans nothing for it" not in words, words  # no problem left out silently
    said = set(re.findall(r"rescale by 2\^-(\d+)", words))
    assert said == {_k(r.factor) for r in plan.regions}, (said, plan.regions)
    named = set(re.findall(r"(?:patch: |; )FP32 island (\S+?)(?=[ ;,|]|$)", words))
    made = {i.module or "the" for i in plan.islands} | {i.site for i in plan.islands if i.site}
    assert named <= made and {i.site or i.module or "the" for i in plan.islands} <= named | made
    for i in plan.islands:
        assert f"FP32 island {i.site or i.module or 'the whole model'}" in words, (i, words)
    for u in plan.unresolved:
        assert u.reason in words, (u, words)


@pytest.mark.parametrize(
    "name", ["seed_case", "embedding_output", "lstm_raw_input", "attention_span"]
)
def test_the_plan_travels_in_the_json_and_renders_without_the_model(name, tmp_path):
    _, _, report = _watched(name)
    back = Report.load(report.save(tmp_path / "r.json"))
    assert back == report and back.advice == report.advice
    assert [s.fix for s in back.spans] == [s.fix for s in report.spans]
    console = Console(width=200, color_system=None, record=True, file=io.StringIO())
    back.print(console=console)
    text = console.export_text()
    assert "Next: patch: " in text
    first = (
        back.spans[0].fix
        if back.spans
        else next(f.fix for f in back.findings if f.mechanism != "note")
    )
    assert first.split(";")[0] in " ".join(text.split())


def test_issue_repros_advise_what_patch_does():
    """The issue's three disagreements: an output span, an input beyond FP16 into an LSTM,
    attention in functional ops."""
    _, _, out = _watched("embedding_output")
    (span,) = out.spans
    assert span.reaches_output and "handing its output on in FP32" in span.fix

    _, _, lstm = _watched("lstm_raw_input")
    (inp,) = [f for f in lstm.findings if f.mechanism == Mechanism.INPUT]
    assert inp.fix.startswith("patch: 2^") and "weight" not in inp.fix.split(";")[1]
    assert lstm.advice.input_scales == {"0": 2.0 ** int(re.search(r"2\^(\d+)", inp.fix).group(1))}

    _, _, attn = _watched("attention_span")
    assert "cannot wrap" not in _words(attn)


def test_a_planner_failure_is_shown_and_the_words_come_from_the_report(monkeypatch):
    import fp16lens.patch._advise as adv

    def broken(*a, **k):
        raise RuntimeError("planner exploded")

    monkeypatch.setattr(adv, "_plan", broken)
    _, _, report = _watched("seed_case")
    assert report.advice.error == "RuntimeError: planner exploded"
    assert report.spans[0].fix == ""  # the view words it from the report alone
    console = Console(width=300, color_system=None, record=True, file=io.StringIO())
    report.print(console=console)
    text = console.export_text()
    assert "fp16lens.patch could not plan this model (RuntimeError: planner exploded)" in text
    assert "fix: rescale by 2^-" in text


def test_advise_false_leaves_the_report_unplanned():
    model, inputs = models.seed_case()
    with torch.no_grad(), fp16lens.watch(model, advise=False) as lens:
        model(*inputs)
    assert lens.report.advice is None and all(s.fix == "" for s in lens.report.spans)


@pytest.mark.parametrize("graph", ["log_eps", "sqrt_div", "seed"])
def test_an_onnx_scan_advises_what_the_onnx_patch_writes(graph, tmp_path):
    """ONNX in: the scan stores the ONNX patch's plan; the FP32 nodes the written file
    names (``fp16lens.fp32_nodes``) are the nodes the advice's islands name."""
    import onnx
    import underflow_graphs as ug

    from fp16lens.patch.onnx._patch import fp32_nodes

    if graph == "seed":
        model, (x,) = models.seed_case()
        path = str(tmp_path / "m.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                (x,),
                path,
                opset_version=17,
                dynamo=False,
                training=torch.onnx.TrainingMode.PRESERVE,
            )
        feed = x
    else:
        path = str(tmp_path / "m.onnx")
        onnx.save(getattr(ug, graph)(), path)
        feed = torch.from_numpy(ug.quiet())
    report = fp16lens.scan(path, [feed], progress=False)
    assert not report.clean and report.advice is not None and report.advice.error == ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp16lens.PatchWarning)
        written = fp16lens.patch(path, report, out=tmp_path / "p.onnx")
    assert report.advice == advice_of(fp16lens.patch.plan(path, report))
    advised = {n for i in report.advice.islands for n in (i["nodes"] or [i["module"]])}
    assert set(fp32_nodes(written)) == advised
    assert all(s.fix.startswith("patch: ") for s in report.spans)
    for f in report.findings_by(Mechanism.UNDERFLOW):
        assert f.fix.startswith("patch: FP32 island"), f.fix


@pytest.mark.parametrize(
    "name", ["log10-clamp", "pow-negative", "clip-in-place-div", "log-square-eps"]
)
def test_underflow_advice_names_the_rule_patch_uses(name):
    """An underflow finding advises the exact rule patch applies (or the island it makes)."""
    import underflow_models as um

    model, x = um.build(name)
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(x)
    report = lens.report
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp16lens.PatchWarning)
        plan = fp16lens.patch.get_plan(fp16lens.patch(model, report))
    assert report.advice == advice_of(plan)
    (f,) = report.findings_by(Mechanism.UNDERFLOW)
    rules = [u for u in plan.underflow_rules if u.site == f.site]
    if rules:
        assert f.fix.startswith(
            f"patch: exact rule {rules[0].rule}: the block scaled up by 2^{rules[0].exponent}"
        )
        assert not plan.islands
    else:
        assert f.fix.startswith("patch: FP32 island") and plan.islands
