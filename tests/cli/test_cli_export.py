"""`fp16lens export` in-process: the file it writes is typed FP16 and computes the model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fp16lens.cli import main

import models

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def test_export_fp16_writes_a_typed_fp16_graph_that_matches_fp32(capsys, tmp_path):
    path = tmp_path / "clean.onnx"
    code = main(["export", "models:clean", "-o", str(path), "--exporter", "torchscript", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["output"] == str(path) and data["precision"] == "fp16"
    proto = onnx.load(str(path))
    float_types = {i.data_type for i in proto.graph.initializer if i.data_type in (1, 10)}
    assert float_types == {onnx.TensorProto.FLOAT16}  # every float weight is stored in FP16
    model, (x,) = models.clean()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    feed = x.numpy() if session.get_inputs()[0].type == "tensor(float)" else x.half().numpy()
    (got,) = session.run(None, {name: feed})
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-3)


def test_export_int8_needs_and_uses_calibration_batches(capsys, tmp_path):
    torch.save([torch.rand(1, 3, 16, 16) for _ in range(2)], tmp_path / "calib.pt")
    path = tmp_path / "clean_int8.onnx"
    argv = [
        "export",
        "models:clean",
        "-o",
        str(path),
        "--precision",
        "int8",
        "--exporter",
        "torchscript",
        "--calibration",
        str(tmp_path / "calib.pt"),
        "--json",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    ops = {n.op_type for n in onnx.load(data["output"]).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    # in a terminal the plan reads one decision per line, each with its numbers
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    bullets = [line[4:] for line in out.splitlines() if line.startswith("  - ")]
    plan = " ".join(next(w for w in data["warnings"] if w.startswith("INT8: ")).split())
    starts = ("equalization", "bias correction", "weight rounding", "weight rounding and bias")
    assert len(bullets) >= 4 and all(b.startswith(starts) for b in bullets), out
    assert sum(b.startswith("weight rounding") for b in bullets) == 2, out
    # each decision whole on its line, its numbers in parentheses with it (rich may wrap a
    # long line; the bullet's first line is the decision's start as the JSON says it)
    assert all(f"; {b.split()[0]}" in plan and b.split("(")[0] in plan for b in bullets), out
    assert all(b.count("(") >= 1 for b in bullets[1:]), out


def test_export_of_an_unknown_island_is_a_user_error(capsys, tmp_path):
    argv = ["export", "models:clean", "-o", str(tmp_path / "m.onnx"), "--fp32-modules", "nope"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp16lens: error: ") and "'nope'" in err and "Traceback" not in err


@pytest.mark.parametrize("target", ["1.5", "-2", "0", "nan", "abc"])
def test_export_target_outside_a_cosine_is_one_line(capsys, tmp_path, target):
    """--target is a worst output cosine: anything outside (0, 1] exits 2 before any model
    loads, with one line that says what it takes (not the library's Int8Target hint)."""
    argv = ["export", "models:clean", "-o", str(tmp_path / "m.onnx"), "--precision", "int8"]
    assert main([*argv, "--target", target]) == 2
    err = capsys.readouterr().err
    assert "argument --target" in err and "in (0, 1]" in err and repr(target) in err
    assert "Traceback" not in err and "Int8Target" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()


def _int8_argv(tmp_path) -> list[str]:
    """`fp16lens export models:clean --precision int8` calibrated on 3 seeded batches."""
    torch.manual_seed(0)
    torch.save([torch.rand(1, 3, 16, 16) for _ in range(3)], tmp_path / "calib.pt")
    calibration = ["--calibration", str(tmp_path / "calib.pt")]
    return [
        "export",
        "models:clean",
        "--precision",
        "int8",
        "--exporter",
        "torchscript",
        *calibration,
    ]


def test_export_int8_target_fails_loudly_when_missed(capsys, tmp_path):
    """--target 1.0 keeps everything out of INT8, beyond the 10% of FLOPs allowed: exit 2,
    one line naming what was reached; --target 0.99 passes and says what it kept."""
    base = _int8_argv(tmp_path)
    assert main([*base, "-o", str(tmp_path / "no.onnx"), "--target", "1.0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp16lens: error: INT8 misses its target") and "Traceback" not in err
    # the way out in the terminal's words: a flag, not the library's keyword
    assert "or --precision fp16" in err and "precision='fp16'" not in err, err
    assert main([*base, "-o", str(tmp_path / "ok.onnx"), "--target", "0.99", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("target 0.99" in w for w in data["warnings"])


def _as_written(path, tmp_path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The PyTorch model's FP32 outputs and the written INT8 file's, on the calibration
    batches: ONNX Runtime with optimizations off (each Q/DQ on its own), not fp16lens."""
    model, _ = models.clean()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    refs, outs = [], []
    for x in torch.load(tmp_path / "calib.pt"):
        with torch.no_grad():
            refs.append(model(x).double().numpy())
        outs.append(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0].astype(np.float64))
    return refs, outs


def _sqnr(refs, outs) -> float:
    return min(10 * np.log10((r**2).sum() / ((o - r) ** 2).sum()) for r, o in zip(refs, outs))


def _float_weights(path) -> list[str]:
    """The Conv/Gemm nodes of a written file whose weight is no DequantizeLinear's output:
    those left out of INT8."""
    graph = onnx.load(str(path)).graph
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    return [
        n.name
        for n in graph.node
        if n.op_type in ("Conv", "Gemm") and n.input[1] not in dequantized
    ]


def _plan(out: str) -> str:
    return next(w for w in json.loads(out)["warnings"] if w.startswith("INT8: "))


def test_export_int8_targets_a_terminal_names(capsys, tmp_path):
    """--target sqnr=40 holds all in INT8 (the summary names the metric); sqnr>=70 keeps
    the classifier Gemm out of INT8 (named with the metric it reaches alone in INT8); both
    files hold their SQNR as written, against the PyTorch model; top1=0.9 names its
    metric."""
    argv = _int8_argv(tmp_path)
    for target, out in (("sqnr=40", []), ("sqnr>=70", ["/fc/Gemm"])):
        path = tmp_path / "m.onnx"
        assert main([*argv, "-o", str(path), "--target", target, "--json"]) == 0, target
        plan = _plan(capsys.readouterr().out)
        threshold = float(target.split("=")[1])
        assert "worst output SQNR (dB)" in plan and f"(target {threshold:g})" in plan, plan
        assert _float_weights(path) == out, target
        assert all(f"{n} (Gemm, error" in plan for n in out), plan
        assert _sqnr(*_as_written(path, tmp_path)) >= threshold - 0.01, target
    assert main([*argv, "-o", str(tmp_path / "t.onnx"), "--target", "top1=0.9", "--json"]) == 0
    assert "top-1 margin kept" in _plan(capsys.readouterr().out)


METRICS = """
import numpy as np


def close(refs, outs):  # a task metric: here, minus the largest error of output 0
    assert isinstance(refs, list) and isinstance(refs[0], list), type(refs)
    assert all(isinstance(a, np.ndarray) for batch in refs + outs for a in batch)
    return -max(float(np.abs(o[0] - r[0]).max()) for r, o in zip(refs, outs))


def raises(refs, outs):
    raise ValueError("no labels here")


def nothing(refs, outs):
    return None
"""


def test_export_int8_target_of_your_own_metric(capsys, tmp_path):
    """--target FILE.py:FUNC=VALUE holds the user's metric, given each batch's FP32 and INT8
    outputs as numpy arrays: the file written holds it as written. A metric that raises,
    returns no number or is not in the file, or a file that is not there: exit 2, one line
    naming the metric, no file written."""
    (tmp_path / "metric.py").write_text(METRICS)
    argv = _int8_argv(tmp_path)
    path = tmp_path / "m.onnx"
    metric = f"{tmp_path / 'metric.py'}:close"
    assert main([*argv, "-o", str(path), "--target", f"{metric}=-0.0002", "--json"]) == 0
    plan = _plan(capsys.readouterr().out)
    assert f"{metric} " in plan and "(target -0.0002)" in plan, plan
    refs, outs = _as_written(path, tmp_path)
    assert max(np.abs(o - r).max() for r, o in zip(refs, outs)) <= 0.0002 + 1e-6
    path.unlink()
    for func, why in (
        ("raises", "raised ValueError: no labels here"),
        ("nothing", "returned None, not a number"),
        ("missing", "has no callable 'missing'"),
    ):
        spec = f"{tmp_path / 'metric.py'}:{func}"
        assert main([*argv, "-o", str(path), "--target", f"{spec}=0.5"]) == 2, func
        err = capsys.readouterr().err
        assert err.startswith(f"fp16lens: error: --target {spec}") and why in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not path.exists()
    assert main([*argv, "-o", str(path), "--target", "nowhere.py:close=0.5"]) == 2
    assert "no file nowhere.py" in capsys.readouterr().err


def test_export_int8_max_fallback_allows_what_the_target_needs(capsys, tmp_path):
    """sqnr=85 holds only with the Gemm, the residual Add and a conv out, 72.7% of the
    FLOPs: the error names the share to allow in the terminal's words; --max-fallback 73%
    then writes a file that holds 85 dB as written with those out."""
    argv = _int8_argv(tmp_path)
    path = tmp_path / "m.onnx"
    assert main([*argv, "-o", str(path), "--target", "sqnr=85"]) == 2
    err = capsys.readouterr().err
    assert "allow that share (--max-fallback 0.73)" in err and "max_fallback=" not in err, err
    assert not path.exists()
    argv += ["-o", str(path), "--target", "sqnr=85", "--max-fallback", "73%", "--json"]
    assert main(argv) == 0
    assert sorted(_float_weights(path)) == ["/fc/Gemm", "/features/features.3/Conv"]
    assert _sqnr(*_as_written(path, tmp_path)) >= 85 - 0.01
    # the plan as data: the target and its score, each unit kept out with its share
    plan = json.loads(capsys.readouterr().out)["int8_plan"]
    assert plan["target"]["metric"] == "worst output SQNR (dB)"
    assert plan["target"]["threshold"] == 85 <= plan["target"]["score"]
    kept = {k["node"]: k for k in plan["kept"]}
    assert set(kept) == {"/fc/Gemm", "/features/features.3/Conv", "/Add"}, kept
    assert 1 - plan["int8_flop_share"] == pytest.approx(sum(k["flop_share"] for k in kept.values()))
    assert 0.1 < 1 - plan["int8_flop_share"] <= 0.73
    assert kept["/fc/Gemm"]["metric_alone"] < 85 and plan["quantized"] == plan["units"] - 3


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--max-fallback", "0.5"], "give --target too"),
        (["--precision", "fp16", "--target", "0.99"], "give --precision int8 with it"),
        (["--target", "0.99", "--max-fallback", "150%"], "argument --max-fallback"),
        (["--target", "sqnr=abc"], "NAME=VALUE with NAME one of cosine, mean-cosine, sqnr"),
        (["--target", "iou=0.9"], "target named 'iou'"),
    ],
)
def test_export_target_mistakes_are_one_line(capsys, tmp_path, extra, why):
    argv = ["export", "models:clean", "-o", str(tmp_path / "m.onnx"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert why in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "m.onnx").exists()


def test_int8_calibrated_on_generated_inputs_says_so(capsys, tmp_path):
    """INT8 calibrated on inputs made from a shape spec fits its ranges to random values,
    and its own check runs on those too: the export says so on stderr, with the shapes and
    the seed, and how to give real batches; with real batches (a --calibration or an
    --input file) it says nothing of the kind, nor for an FP16 export."""
    out = str(tmp_path / "m.onnx")
    base = ["export", "models:clean", "-o", out, "--exporter", "torchscript"]
    assert main([*base, "--precision", "int8", "--input", "1x3x16x16", "--seed", "3"]) == 0
    err = capsys.readouterr().err
    assert "note: INT8 is calibrated on generated inputs (1x3x16x16: random values, seed 3)" in err
    assert "give real batches (--calibration FILE, or an --input file)" in err
    torch.manual_seed(0)
    torch.save([torch.rand(1, 3, 16, 16) for _ in range(2)], tmp_path / "cal.pt")
    for real in (
        ["--calibration", str(tmp_path / "cal.pt")],
        ["--input", str(tmp_path / "cal.pt")],
    ):
        assert main([*base, "--precision", "int8", *real]) == 0
        assert "generated inputs" not in capsys.readouterr().err
    assert main([*base, "--input", "1x3x16x16"]) == 0
    assert "generated inputs" not in capsys.readouterr().err
