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
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from zoo_real import onnx_real_fp16  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens.cli import main  # noqa: E402

F = TensorProto.FLOAT


def _const(name: str, value) -> object:
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def _model(nodes, inits, shape=(4, 16)):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, list(shape))],
                          [helper.make_tensor_value_info("y", F, None)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _square_eps(eps: float) -> list:
    return [helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
            helper.make_node("Add", ["sq", "eps"], ["den"], name="add_eps")]


def log_eps(eps: float = 1e-10):
    """log(x² + eps): the log-spectrogram front end."""
    return _model([*_square_eps(eps), helper.make_node("Log", ["den"], ["y"], name="log")],
                  [_const("eps", eps)])


def sqrt_div(eps: float = 1e-12):
    """x / sqrt(x² + eps)."""
    return _model([*_square_eps(eps), helper.make_node("Sqrt", ["den"], ["rt"], name="sqrt"),
                   helper.make_node("Div", ["x", "rt"], ["y"], name="div")], [_const("eps", eps)])


def reciprocal(eps: float = 1e-10):
    return _model([*_square_eps(eps), helper.make_node("Reciprocal", ["den"], ["y"], name="recip")],
                  [_const("eps", eps)])


def pow_neg(eps: float = 1e-10):
    """(x² + eps)^-0.5: an rsqrt."""
    return _model([*_square_eps(eps), helper.make_node("Pow", ["den", "e"], ["y"], name="rsqrt")],
                  [_const("eps", eps), _const("e", -0.5)])


def softmax_by_hand():
    """exp(x) / Σ exp(x), written without the max subtraction."""
    return _model([helper.make_node("Exp", ["x"], ["e"], name="exp"),
                   helper.make_node("ReduceSum", ["e", "axes"], ["s"], name="sum", keepdims=1),
                   helper.make_node("Div", ["e", "s"], ["y"], name="div")],
                  [numpy_helper.from_array(np.array([1], np.int64), "axes")])


def lp_norm():
    return _model([helper.make_node("Mul", ["x", "k"], ["small"], name="scale"),
                   helper.make_node("LpNormalization", ["small"], ["y"], name="lpnorm", axis=1, p=2)],
                  [_const("k", 1e-4)])


def square_into_conv(eps: float = 1e-10):
    """The same flushing x² + eps, read by a Conv: no singular node, nothing breaks."""
    w = np.random.default_rng(0).standard_normal((2, 1, 3)).astype(np.float32)
    return _model([*_square_eps(eps),
                   helper.make_node("Conv", ["den", "w"], ["y"], name="conv", pads=[1, 1])],
                  [_const("eps", eps), _const("w", w)], shape=(4, 1, 16))


def _quiet(shape=(4, 16), seed: int = 0):
    """A quiet signal: |x| from 1e-6 to 1, so part of x² is below FP16's 2^-24."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-6, 0, shape)
    return (mag * rng.choice([-1, 1], shape)).astype(np.float32)


def _real_breaks(model, x, tmp_path) -> bool:
    """Ground truth: real FP16 gives a non-finite output where FP32 does not."""
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    import onnxruntime as ort

    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    half = onnx_real_fp16(path, {"x": x})["y"]
    return bool((~np.isfinite(half) & np.isfinite(ref)).any())


CASES = [  # (name, graph, input, real FP16 breaks)
    ("log", log_eps(), _quiet(), True),
    ("sqrt-div", sqrt_div(), _quiet(), True),
    ("reciprocal", reciprocal(), _quiet(), True),
    ("pow-0.5", pow_neg(), _quiet(), True),
    ("softmax", softmax_by_hand(), np.random.default_rng(1).uniform(-40, -20, (4, 16)).astype(np.float32), True),
    # clean controls: an eps FP16 holds, values that never flush, a flush that meets a Conv
    ("log-eps-1e-3", log_eps(1e-3), _quiet(), False),
    ("log-loud", log_eps(), np.random.default_rng(3).uniform(0.5, 2, (4, 16)).astype(np.float32), False),
    ("softmax-mild", softmax_by_hand(), np.random.default_rng(1).uniform(-4, 4, (4, 16)).astype(np.float32), False),
    ("conv", square_into_conv(), _quiet((4, 1, 16)), False),
    # a row FP16 flushes whole: ONNX Runtime's LpNormalization gives 0 for a zero norm
    ("lpnorm", lp_norm(), np.random.default_rng(2).uniform(-1e-4, 1e-4, (4, 16)).astype(np.float32), False),
]


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


def test_the_finding_names_the_flushing_producer_and_the_vanished_eps():
    report = fp16lens.scan(log_eps(), [_quiet()], progress=False)
    (f,) = report.findings_by("underflow")
    assert f.site == "log" and f.tensor == "square"
    assert "square" in f.detail and "1e-10" in f.detail and "add_eps" in f.detail
    flushed = np.float16(_quiet() ** 2 + np.float32(1e-10)) == 0
    assert f.peak == pytest.approx(flushed.mean())  # the share FP16 makes 0 at the log
    # the eps, harmless by magnitude, is a problem in this context (constant harm in context)
    (eps,) = [p for p in report.findings if p.tensor == "eps"]
    assert eps.mechanism == "parameter" and "flush too" in eps.detail and "log" in eps.detail


def test_a_flushed_eps_joining_values_that_never_flush_stays_a_note():
    x = np.random.default_rng(3).uniform(0.5, 2, (4, 16)).astype(np.float32)
    report = fp16lens.scan(log_eps(), [x], progress=False)
    (eps,) = [p for p in report.findings if p.tensor == "eps"]
    assert eps.mechanism == "note" and "harmless" in eps.detail and report.clean


def test_cli_fail_on_underflow_and_any(tmp_path, capsys):
    path = tmp_path / "log.onnx"
    onnx.save(log_eps(), str(path))
    np.savez(tmp_path / "in.npz", x=_quiet())
    for policy in ("underflow", "any"):
        code = main(["scan", str(path), "--input", str(tmp_path / "in.npz"), "--fail-on", policy,
                     "--json", "--no-progress"])
        data = json.loads(capsys.readouterr().out)
        assert code == 1 and not data["clean"]
    code = main(["scan", str(path), "--input", str(tmp_path / "in.npz"), "--fail-on", "overflow",
                 "--no-progress"])
    capsys.readouterr()
    assert code == 0  # not an overflow
    onnx.save(log_eps(1e-3), str(path))
    assert main(["scan", str(path), "--input", str(tmp_path / "in.npz"), "--fail-on", "any",
                 "--no-progress"]) == 0
