"""`fp16lens demo` end to end as a subprocess: exit 0, the FP16 ONNX on disk, overflow
before and none after; the ONNX file is checked with ONNX Runtime, independently."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fp16lens.demo import OVERFLOW_SITE, build_demo_model


@pytest.mark.slow
def test_demo_subprocess_end_to_end(tmp_path):
    out = tmp_path / "demo-out"
    env = {**os.environ, "COLUMNS": "100"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fp16lens", "demo", "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert [s["start"] for s in summary["spans_before"]] == [OVERFLOW_SITE]
    assert summary["spans_before"][0]["peak"] > 65504
    assert summary["spans_after"] == [] and summary["fixed"]
    assert summary["nonfinite_before"] and not summary["parity_before"]
    assert summary["cosine_after"] > 0.999 and summary["parity_after"]
    fp16_onnx = out / "demo_fp16.onnx"
    assert summary["files"]["onnx_fp16"] == str(fp16_onnx) and fp16_onnx.is_file()
    assert (out / "report.json").is_file()
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "torchvision" not in imported  # the built-in model needs no torchvision
    # the demo proves its own patch in real FP16: no warning asking the user to
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]

    ort = pytest.importorskip("onnxruntime")
    model, (x,) = build_demo_model()
    session = ort.InferenceSession(str(fp16_onnx), providers=["CPUExecutionProvider"])
    meta = session.get_inputs()[0]
    feed = x.numpy() if meta.type == "tensor(float)" else x.half().numpy()
    (got,) = session.run(None, {meta.name: feed})
    with torch.no_grad():
        want = model(x).numpy()
    assert np.isfinite(got).all()
    cosine = float(
        np.dot(got.ravel().astype(np.float64), want.ravel())
        / (np.linalg.norm(got.astype(np.float64)) * np.linalg.norm(want))
    )
    assert cosine > 0.999


@pytest.mark.slow
def test_demo_text_output_in_process(capsys, tmp_path):
    from fp16lens.cli import main

    code = main(["demo", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert OVERFLOW_SITE in out and "before and after" in out and "PASSED" in out
