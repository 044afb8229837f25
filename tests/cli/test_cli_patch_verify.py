"""`fp16lens patch` and `fp16lens verify` in-process on the demo model; the patched file
is checked in real FP16 (`.half()` on the CPU) independently of fp16lens.verify."""

from __future__ import annotations

import json

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
