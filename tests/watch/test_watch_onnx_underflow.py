"""Underflow that breaks, in ONNX graphs (mechanism "underflow", kind "flush-singular"):
values FP16 flushes to 0 (a tiny square, an exp far below 1, an eps FP16 cannot hold)
reaching a node where 0 is singular. Small graphs built with onnx.helper, one per singular
op, each judged against real FP16 (``zoo_real.onnx_real_fp16``: FP16 storage of every
tensor in ONNX Runtime, built without fp16lens): flagged exactly where real FP16 gives
non-finite values that FP32 does not."""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from underflow_graphs import (  # noqa: E402
    div_no_nan,
    log_clip,
    log_eps,
    lp_norm,
    pow_neg,
    quiet,
    reciprocal,
    softmax_by_hand,
    sqrt_div,
    square_into_conv,
)
from zoo_real import onnx_real_fp16  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens.cli import main  # noqa: E402


def _real_breaks(model, x, tmp_path) -> bool:
    """Ground truth: real FP16 gives a non-finite output where FP32 does not."""
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    import onnxruntime as ort

    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    half = onnx_real_fp16(path, {"x": x})["y"]
    return bool((~np.isfinite(half) & np.isfinite(ref)).any())


CASES = [  # (name, graph, input, real FP16 breaks)
    ("log", log_eps(), quiet(), True),
    ("log-clamp", log_clip(), quiet(), True),
    ("sqrt-div", sqrt_div(), quiet(), True),
    ("reciprocal", reciprocal(), quiet(), True),
    ("pow-0.5", pow_neg(), quiet(), True),
    (
        "softmax",
        softmax_by_hand(),
        np.random.default_rng(1).uniform(-40, -20, (4, 16)).astype(np.float32),
        True,
    ),
    # clean controls: an eps FP16 holds, values that never flush, a flush that meets a Conv
    ("log-eps-1e-3", log_eps(1e-3), quiet(), False),
    ("log-clamp-1e-4", log_clip(1e-4), quiet(), False),
    (
        "log-loud",
        log_eps(),
        np.random.default_rng(3).uniform(0.5, 2, (4, 16)).astype(np.float32),
        False,
    ),
    (
        "softmax-mild",
        softmax_by_hand(),
        np.random.default_rng(1).uniform(-4, 4, (4, 16)).astype(np.float32),
        False,
    ),
    ("conv", square_into_conv(), quiet((4, 1, 16)), False),
]


def test_a_row_fp16_flushes_whole_is_no_singular_op_but_no_clean_verdict(tmp_path):
    """x * 1e-4 on x below 1e-4 is below 2^-24: FP16 stores 0, and ONNX Runtime's
    LpNormalization gives 0 for a zero norm, so real FP16 holds no inf/NaN (no underflow
    finding) but outputs zeros where FP32 outputs unit rows: the verdict's own real-FP16
    run says so, and names the scale as where the values flush."""
    import zoo_real

    x = np.random.default_rng(2).uniform(-1e-4, 1e-4, (4, 16)).astype(np.float32)
    model = lp_norm()
    assert not _real_breaks(model, x, tmp_path)
    path = str(tmp_path / "lp.onnx")
    onnx.save(model, path)
    (half,) = zoo_real.onnx_real_fp16(path, {"x": x}).values()
    assert not half.any()  # ground truth: zeros for rows of norm 1
    report = fp16lens.scan(model, [x], progress=False)
    assert not report.findings_by("underflow") and not report.clean
    (f,) = report.findings
    assert (f.kind, f.site) == ("fp16-run", "scale")
    assert "fp32_nodes=['scale', 'lpnorm']" in f.detail


@pytest.mark.parametrize(("name", "model", "x", "breaks"), CASES, ids=[c[0] for c in CASES])
def test_flagged_exactly_where_real_fp16_goes_non_finite(name, model, x, breaks, tmp_path):
    assert _real_breaks(model, x, tmp_path) == breaks  # the case is what it claims
    report = fp16lens.scan(model, [x], progress=False)
    found = report.findings_by("underflow")
    assert bool(found) == breaks
    assert report.clean == (not breaks)
    for f in found:
        assert f.kind == "flush-singular" and 0 < f.peak <= 1 and f.count > 0
        assert f.site in ("log", "div", "recip", "rsqrt")
        assert "non-finite" in f.detail and f.fix


def test_a_masked_divide_is_no_underflow_but_its_vanished_eps_still_shows(tmp_path):
    """TensorFlow's div_no_nan: Where(den == 0, 0, x / den). Real FP16 stays finite (the
    Where takes the 0), so there is no underflow finding; but where FP16 flushed den the
    output is 0 instead of x / eps, so the eps that kept den off 0 is a problem."""
    import onnxruntime as ort

    x = quiet()
    assert not _real_breaks(div_no_nan(), x, tmp_path)
    report = fp16lens.scan(div_no_nan(), [x], progress=False)
    assert report.findings_by("underflow") == []
    (eps,) = [p for p in report.findings if p.tensor == "eps"]
    assert eps.mechanism == "parameter" and "flush too" in eps.detail
    ref = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0]
    half = onnx_real_fp16(str(tmp_path / "m.onnx"), {"x": x})["y"]
    assert ((half == 0) & (np.abs(ref) > 1)).any()  # what the vanished eps costs


def test_the_finding_names_the_flushing_producer_and_the_vanished_eps():
    report = fp16lens.scan(log_eps(), [quiet()], progress=False)
    (f,) = report.findings_by("underflow")
    assert f.site == "log" and f.tensor == "square"
    assert "square" in f.detail and "1e-10" in f.detail and "add_eps" in f.detail
    flushed = np.float16(quiet() ** 2 + np.float32(1e-10)) == 0
    assert f.peak == pytest.approx(flushed.mean())  # the share FP16 makes 0 at the log
    # the eps, harmless by magnitude, is a problem in this context (constant harm in context)
    (eps,) = [p for p in report.findings if p.tensor == "eps"]
    assert eps.mechanism == "parameter" and "flush too" in eps.detail and "log" in eps.detail


def test_a_flushed_clamp_bound_is_named_and_a_problem():
    report = fp16lens.scan(log_clip(), [quiet()], progress=False)
    (f,) = report.findings_by("underflow")
    assert f.site == "log" and f.tensor == "square" and "1e-12 at clamp" in f.detail
    (lo,) = [p for p in report.findings if p.tensor == "lo"]
    assert lo.mechanism == "parameter" and "flush too" in lo.detail


def test_a_flushed_eps_joining_values_that_never_flush_stays_a_note():
    x = np.random.default_rng(3).uniform(0.5, 2, (4, 16)).astype(np.float32)
    report = fp16lens.scan(log_eps(), [x], progress=False)
    (eps,) = [p for p in report.findings if p.tensor == "eps"]
    assert eps.mechanism == "note" and "harmless" in eps.detail and report.clean


def test_cli_fail_on_underflow_and_any(tmp_path, capsys):
    path = tmp_path / "log.onnx"
    onnx.save(log_eps(), str(path))
    np.savez(tmp_path / "in.npz", x=quiet())
    for policy in ("underflow", "any"):
        code = main(
            [
                "scan",
                str(path),
                "--input",
                str(tmp_path / "in.npz"),
                "--fail-on",
                policy,
                "--json",
                "--no-progress",
            ]
        )
        data = json.loads(capsys.readouterr().out)
        assert code == 1 and not data["clean"]
    code = main(
        [
            "scan",
            str(path),
            "--input",
            str(tmp_path / "in.npz"),
            "--fail-on",
            "overflow",
            "--no-progress",
        ]
    )
    capsys.readouterr()
    assert code == 0  # not an overflow
    onnx.save(log_eps(1e-3), str(path))
    assert (
        main(
            [
                "scan",
                str(path),
                "--input",
                str(tmp_path / "in.npz"),
                "--fail-on",
                "any",
                "--no-progress",
            ]
        )
        == 0
    )
