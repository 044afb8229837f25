"""`fp16lens patch` and `fp16lens verify` in-process on the demo model; the patched file
is checked in real FP16 (`.half()` on the CPU) independently of fp16lens.verify."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fp16lens.cli import main
from fp16lens.demo import build_demo_model


@pytest.fixture(scope="module")
def patched_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("patch")
    report = folder / "report.json"
    assert main(["scan", "demo", "--save", str(report), "--no-progress", "--json"]) == 0
    return folder, report


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def test_patch_writes_a_model_that_real_fp16_runs(patched_file, capsys):
    folder, report = patched_file
    capsys.readouterr()
    out = folder / "patched.pt2"
    code = main(["patch", "demo", "--report", str(report), "-o", str(out), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["output"] == str(out) and data["plan"]["regions"]
    model, (x,) = build_demo_model()
    patched = torch.export.load(str(out)).module()
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(patched(x), want, rtol=1e-4, atol=1e-4)  # same FP32 model
        half = patched.half()(x.half()).float()
    assert torch.isfinite(half).all()
    assert _cosine(half, want) > 0.999

    code = main(["verify", "demo", str(out), "--json"])
    parity = json.loads(capsys.readouterr().out)
    assert code == 0 and parity["passed"] and parity["backend"] == "torch-fp16"
    assert parity["cosine"] == pytest.approx(_cosine(half, want), abs=1e-3)


def test_verify_fails_the_unpatched_model_with_exit_1(capsys):
    model, (x,) = build_demo_model()
    with torch.no_grad():
        assert not torch.isfinite(model.half()(x.half())).all()  # the ground truth
    code = main(["verify", "demo", "demo", "--json"])
    parity = json.loads(capsys.readouterr().out)
    assert code == 1 and not parity["passed"] and parity["nonfinite"]


def test_patch_and_verify_user_errors(patched_file, capsys, tmp_path):
    _, report = patched_file
    assert main(["patch", "demo", "--report", str(tmp_path / "no.json"), "-o", "x.pt2"]) == 2
    assert "cannot read report" in capsys.readouterr().err
    assert main(["patch", "demo", "--report", str(report), "-o", str(tmp_path / "x.bin")]) == 2
    assert "use .pt" in capsys.readouterr().err
    assert main(["verify", "demo", str(tmp_path / "missing.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp16lens: error: ") and "missing.onnx does not exist" in err


@pytest.mark.slow  # a scan and two proofs on the demo detector, ~60 s
def test_patch_says_when_only_precision_kept_the_whole_model_fp32(tmp_path, capsys):
    """Raw 0-255 pixels: the rescaled demo model's real FP16 is finite, cosine 0.998, short
    of the default 0.999; the CLI says so with the --min-cosine that keeps it FP16."""
    _, (x,) = build_demo_model()
    raw = (x - x.min()) / (x.max() - x.min()) * 255
    torch.save(raw, tmp_path / "raw.pt")
    report, out = tmp_path / "raw.json", tmp_path / "p.pt2"
    scan = ["scan", "demo", "--input", str(tmp_path / "raw.pt"), "--save", str(report)]
    assert main([*scan, "--no-progress", "--json"]) == 0
    patch = ["patch", "demo", "--report", str(report), "--input", str(tmp_path / "raw.pt")]
    capsys.readouterr()
    assert main([*patch, "-o", str(out)]) == 0
    said = re.sub(r"\s+", " ", capsys.readouterr().out)  # rich wraps long lines
    found = re.search(r"short only in precision.*--min-cosine ([0-9.]+) keeps the rescaled", said)
    assert found and "the whole model is kept FP32" in said, said
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    assert main(["export", str(out), "-o", str(tmp_path / "whole.onnx")]) == 0  # the file kept
    graph = onnx.load(str(tmp_path / "whole.onnx")).graph
    assert not [t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
    sess = ort.InferenceSession(str(tmp_path / "whole.onnx"), providers=["CPUExecutionProvider"])
    (inp,) = sess.get_inputs()
    half_io = inp.type == "tensor(float16)"  # FP16 inputs and outputs, FP32 inside
    got = sess.run(None, {inp.name: raw.numpy().astype("float16" if half_io else "float32")})[0]
    got = torch.from_numpy(got).float()
    assert _cosine(got, build_demo_model()[0](raw).detach()) > 0.9999
    capsys.readouterr()
    assert main([*patch, "-o", str(out), "--min-cosine", found.group(1), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["proven"] and not data["fp32_modules"]  # all FP16, rescaled
    patched = torch.export.load(str(out)).module()
    with torch.no_grad():  # ground truth without fp16lens: the file in real FP16
        half = patched.half()(raw.half()).float()
        want = build_demo_model()[0](raw)
    assert torch.isfinite(half).all() and _cosine(half, want) >= float(found.group(1))
    assert main([*patch, "-o", str(out), "--min-cosine", "2"]) == 2
    assert "min_cosine must be within [-1, 1]" in capsys.readouterr().err
