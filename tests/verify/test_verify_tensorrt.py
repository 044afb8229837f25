"""TensorRT backends: run where TensorRT and a GPU exist; their absence is an Fp16LensError."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from fp16lens.verify import verify

from models import clean, seed_case


def test_missing_runtimes_raise_and_import_stays_lean():
    """One subprocess: importing verify loads no runtime; without tensorrt / torch_tensorrt
    the backends raise MissingDependencyError naming the extra."""
    code = textwrap.dedent("""
        import sys
        import fp16lens.verify
        print("LOADED", [m for m in ("onnx", "onnxruntime", "tensorrt", "polygraphy", "torch_tensorrt")
                         if m in sys.modules])
        sys.modules["tensorrt"] = sys.modules["torch_tensorrt"] = None
        import torch
        from fp16lens import MissingDependencyError
        from fp16lens.verify import verify
        model, x = torch.nn.Linear(2, 2), torch.ones(1, 2)
        for candidate, backend in (("model.onnx", "tensorrt"), (model, "torch-tensorrt")):
            try:
                verify(model, candidate, x, backend=backend)
            except MissingDependencyError as exc:
                print("MISSING", backend, exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in done.stdout, done.stdout + done.stderr
    assert "MISSING tensorrt" in done.stdout and "pip install -e '.[trt]'" in done.stdout
    assert "MISSING torch-tensorrt" in done.stdout and "pip install -e '.[torchtrt]'" in done.stdout


@pytest.mark.tensorrt
@pytest.mark.gpu
def test_tensorrt_fails_on_the_seed_case_and_passes_clean(tmp_path):
    from fp16lens.export import export

    model, inputs = seed_case()
    path = tmp_path / "seed.onnx"
    export(model, inputs, path, precision="fp16")
    result = verify(model.cuda(), path, tuple(x.cuda() for x in inputs), backend="tensorrt")
    assert not result and result.first_divergence == "backbone.layer4.1.bn2"
    model, inputs = clean()
    export(model, inputs, tmp_path / "clean.onnx", precision="fp16")
    assert verify(model, tmp_path / "clean.onnx", inputs, backend="tensorrt")


@pytest.mark.torchtrt
@pytest.mark.gpu
def test_torch_tensorrt_fails_on_the_seed_case_and_passes_clean():
    model, inputs = seed_case()
    model, inputs = model.cuda(), tuple(x.cuda() for x in inputs)
    result = verify(model, model, inputs, backend="torch-tensorrt")
    assert not result and result.first_divergence == "backbone.layer4.1.bn2"
    model, inputs = clean()
    assert verify(
        model.cuda(), model.cuda(), tuple(x.cuda() for x in inputs), backend="torch-tensorrt"
    )
    assert torch.cuda.is_available()


def test_tensorrt_result_says_how_divergence_is_localized():
    """The TensorRT runner's own note survives the ONNX runner's artifact notes (built
    without TensorRT: only the notes are asked for)."""
    from pathlib import Path

    from fp16lens.verify._tensorrt import TensorRTRunner

    runner = TensorRTRunner.__new__(TensorRTRunner)
    runner.path, runner.types = Path("m.onnx"), {}  # an artifact with no FP16 tensor
    notes = runner._notes()
    assert notes[-1] == TensorRTRunner.LOCALIZED
    assert any("holds no FP16 tensor" in n for n in notes)
