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


def test_export_int8_target_fails_loudly_when_missed(capsys, tmp_path):
    """--target 1.0 keeps everything out of INT8, beyond the 10% of FLOPs allowed: exit 2,
    one line naming what was reached; --target 0.99 passes and says what it kept."""
    torch.save([torch.rand(1, 3, 16, 16) for _ in range(3)], tmp_path / "calib.pt")
    base = [
        "export",
        "models:clean",
        "--precision",
        "int8",
        "--exporter",
        "torchscript",
        "--calibration",
        str(tmp_path / "calib.pt"),
    ]
    assert main([*base, "-o", str(tmp_path / "no.onnx"), "--target", "1.0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp16lens: error: INT8 misses its target") and "Traceback" not in err
    # the way out in the terminal's words: a flag, not the library's keyword
    assert "or --precision fp16" in err and "precision='fp16'" not in err, err
    assert main([*base, "-o", str(tmp_path / "ok.onnx"), "--target", "0.99", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("target 0.99" in w for w in data["warnings"])
