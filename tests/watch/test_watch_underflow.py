"""watch() finds underflow that breaks (mechanism "underflow", kind "flush-singular"): values
FP16 makes 0 reaching a log, a denominator, an rsqrt or a negative power. Ground truth is a
real FP16 run on the CPU (``copy.deepcopy(model).half()(x.half())``): the report says
underflow exactly when that run gives inf/NaN while FP32 is finite."""

from __future__ import annotations

import copy

import pytest
import torch
import underflow_models as um

from fp16lens import watch
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.cli import main


def _real_nonfinite(model, x) -> int:
    with torch.no_grad():
        assert model(x).isfinite().all()  # FP32 is fine: FP16 alone breaks it
        return int((~copy.deepcopy(model).half()(x.half()).isfinite()).sum())


def _report(model, x):
    with torch.no_grad(), watch(model) as lens:
        model(x)
    return lens.report


@pytest.mark.parametrize("name", [*um.FAILING, *um.CLEAN])
def test_verdict_matches_real_fp16(name):
    model, x = um.build(name)
    bad = _real_nonfinite(model, x)
    report = _report(model, x)
    found = report.findings_by(Mechanism.UNDERFLOW)
    assert (bad > 0) == bool(found) == (not report.clean), (name, bad, found)
    assert (bad > 0) == (name in um.FAILING)
    for f in found:
        assert f.kind == FindingKind.FLUSH_SINGULAR and f.site.startswith("block:")
        # per value, within a row's width: a row's denominator spreads over the row after
        # it (rsqrt), a row of values is reduced after the divide (cosine similarity)
        assert bad / um.WIDTH <= f.count <= bad * um.WIDTH, (f.count, bad)
        assert 0 < f.peak <= 1


@pytest.mark.parametrize("name", ["softmax-by-hand", "normalize", "log-square-eps"])
def test_count_is_exact_where_rows_flush_whole(name):
    """A divide by a sum of exps is 0/0 only where a whole row flushes: predicted per row."""
    model, x = um.build(name)
    (f,) = _report(model, x).findings_by(Mechanism.UNDERFLOW)
    assert f.count == _real_nonfinite(model, x)


def test_partial_rows_of_flushed_exps_stay_finite():
    """Most exps of every row flush, but one per row survives: the sum is not 0, FP16 is
    finite, and the verdict stays clean."""
    model, x = um.build("softmax-by-hand")
    x = x.clone()
    w = torch.linalg.pinv(model.front.weight.detach())
    x[:3] += w @ torch.eye(um.WIDTH)[0] * 30.0  # element 0 of the front's rows back near 0
    assert _real_nonfinite(model, x) == 0
    assert _report(model, x).clean


def test_report_names_op_origin_and_vanished_constant():
    model, x = um.build("log10-clamp")
    (f,) = _report(model, x).findings_by(Mechanism.UNDERFLOW)
    assert f.site == "block:log10" and f.tensor == "block:mul"
    assert (
        "block:mul" in f.detail
        and "clamp bound 1e-08" in f.detail
        and "log10(0) = -inf" in f.detail
    )
    model, x = um.build("log-square-eps")
    (f,) = _report(model, x).findings_by(Mechanism.UNDERFLOW)
    assert "eps 1e-10" in f.detail  # the constant that vanished
    assert f.fix.startswith(
        "patch: FP32 island block (rule: FP32 island of the block; no exact rule: "
    )


def test_rendered_verdict_is_not_fp16_safe():
    model, x = um.build("softmax-by-hand")
    report = _report(model, x)
    from rich.console import Console

    console = Console(record=True, width=120, color_system=None)
    console.print(report)
    text = console.export_text()
    assert "FP16-safe" not in text and "1 underflow problem" in text
    assert "block:div" in text and "block:exp" in text


def test_clean_control_renders_safe():
    model, x = um.build("relu-flush-linear")
    report = _report(model, x)
    assert report.sites["front"].underflow > 0  # small values do flush, harmlessly
    from rich.console import Console

    console = Console(record=True, width=120, color_system=None)
    console.print(report)
    assert "✓" in console.export_text()


REPRO = """
import sys
sys.path.insert(0, {tests!r})
import underflow_models as um


def build():
    model, x = um.build({name!r})
    return model, (x,)
"""


@pytest.mark.parametrize(
    "policy, name, code",
    [
        ("underflow", "softmax-by-hand", 1),
        ("any", "log-square-eps", 1),
        ("overflow", "log-square-eps", 0),
        ("any", "log-eps-1e-3", 0),
    ],
)
def test_cli_fail_on_underflow(tmp_path, capsys, policy, name, code):
    import os

    path = tmp_path / "m.py"
    path.write_text(REPRO.format(tests=os.path.dirname(os.path.dirname(__file__)), name=name))
    assert main(["scan", f"{path}:build", "--fail-on", policy]) == code
    capsys.readouterr()


# ---- trained weights: PESTO (pesto-pitch 2.0.1), a pitch estimator, on real audio ------------


def _pesto():
    import zoo_real

    try:
        return zoo_real, zoo_real.pesto_audio()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("kind", ["speech", "gated-tone"])
def test_pesto_confidence_breaks_where_watch_says(kind):
    """Its confidence head divides exp(mean(log e)) by mean(e).clip_(min=1e-8), e = the CQT
    energy: in silent frames every e flushes, the clip bound is 0 in FP16 too, 0/0 = NaN."""
    zoo_real, model = _pesto()
    speech = zoo_real.speech() / 32768.0
    x = speech if kind == "speech" else zoo_real.gated_tone(speech.shape[1])
    with torch.no_grad():
        ref = model(x)
        real = copy.deepcopy(model).half()(x.half())
    assert all(r.isfinite().all() for r in ref)
    bad = int((~real[1].isfinite()).sum())  # confidence
    assert bad > 0 and all(r.isfinite().all() for i, r in enumerate(real) if i != 1)
    report = _report(model, x)
    assert not report.clean
    found = {f.site: f for f in report.findings_by(Mechanism.UNDERFLOW)}
    div = found["pesto.confidence:div"]
    assert div.count == bad  # per frame: exactly the frames real FP16 makes NaN
    assert div.tensor == "pesto:exp" and "clamp bound 1e-08" in div.detail
    assert "pesto.confidence:log" in found  # log(0) = -inf on the way (mean, exp: 0)


def test_compiled_scan_counts_as_the_eager_scan():
    """scan(compile=True) captures the counts as graph outputs: the same findings per batch
    (the captured graph run as it is: backend "fx")."""
    import fp16lens
    from fp16lens.watch._compiled_scan import scan_compiled

    model, x = um.build("softmax-by-hand")
    batches = [(x,), (x * 1.1,), (x * 0.9,), (x[:, :] * 1.2,)]
    eager = fp16lens.scan(model, batches, progress=False)
    compiled, timings = scan_compiled(model, batches, progress=False, backend="fx")
    assert timings.compiled_batches == 2
    want = [(f.site, f.count, f.tensor) for f in eager.findings_by(Mechanism.UNDERFLOW)]
    got = [(f.site, f.count, f.tensor) for f in compiled.findings_by(Mechanism.UNDERFLOW)]
    assert want == got and want[0][1] == 4 * 48


def _crepe():
    import zoo_real

    try:
        return zoo_real, zoo_real.crepe_audio()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))


def test_crepe_silent_frames_break_where_watch_says():
    """torchcrepe normalizes each frame by max(1e-10, std): in a silent frame std is 0 and
    1e-10 is 0 in FP16, so 0/0 = NaN for the whole frame. Speech has no silent frame (its
    real FP16 run is finite); a tone gated on and off does."""
    zoo_real, model = _crepe()
    x = zoo_real.gated_tone(16000)  # 0.5 s of 220 Hz, 0.5 s of silence
    with torch.no_grad():
        assert model(x).isfinite().all()
        real = copy.deepcopy(model).half()(x.half())
    rows = int((~real.isfinite()).any(dim=1).sum())
    assert rows > 0 and int((~real.isfinite()).sum()) == rows * real.shape[1]  # whole frames
    (f,) = _report(model, x).findings_by(Mechanism.UNDERFLOW)
    assert f.site == "frames:div" and "eps 1e-10" in f.detail
    assert f.count == rows * 1024  # every sample of each silent frame: 0/0


def test_crepe_on_speech_is_clean_as_real_fp16_is_finite():
    """The clean control on trained weights: speech has no silent frame; tiny stds flush
    nothing that reaches the divide."""
    zoo_real, model = _crepe()
    x = zoo_real.speech(1.0) / 32768.0
    with torch.no_grad():
        assert copy.deepcopy(model).half()(x.half()).isfinite().all()
    assert not _report(model, x).findings_by(Mechanism.UNDERFLOW)


def test_flush_threshold_is_fp16s():
    """``flushes`` says 0 in FP16 exactly where a real FP16 cast gives 0."""
    from fp16lens._core.underflow import flushes

    values = torch.logspace(-12, -5, 4001, dtype=torch.float64).float()
    values = torch.cat([values, torch.tensor([2.0**-25, 2.0**-24, 1e-8, 1e-7, 1e-10, 1e-12])])
    for v in values.tolist():
        assert flushes(v) == flushes(-v) == (torch.tensor(v).half().item() == 0), v


def test_reports_of_two_ranks_sum_the_counts():
    from fp16lens.report import merge_reports

    model, x = um.build("softmax-by-hand")
    a, b = _report(model, x), _report(model, x[:3])
    (f,) = merge_reports([a, b]).findings_by(Mechanism.UNDERFLOW)
    assert f.count == 48 + 48
