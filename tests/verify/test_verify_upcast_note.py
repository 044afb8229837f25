"""The fp32-upcast note's advice, end to end: a Llama/T5-style RMS norm that upcasts is
fine under .half() (real FP16: finite), overflows in an FP16 ONNX graph converted from the
FP32 export (no upcast there), and is fine again with the module the note names kept FP32."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import fp16lens
from fp16lens.export import export
from fp16lens.report._advice import suggest_fix
from fp16lens.verify import verify

from models import UpcastNormNet


def test_upcast_note_names_the_module_to_keep_fp32(tmp_path):
    torch.manual_seed(3)
    model, x = UpcastNormNet().eval(), torch.randn(2, 4, 16)
    with torch.no_grad():
        assert torch.isfinite(model.half()(x.half())).all()  # real FP16: the upcast holds
        model.float()
        with fp16lens.watch(model) as lens:
            model(x)
    report = lens.report
    assert report.spans == [] and report.clean
    (note,) = [f for f in report.findings if f.kind == "fp32-upcast"]
    assert note.mechanism == "note" and note.site == "norm:pow" and note.peak > 65504
    assert "fp32_modules=['norm']" in suggest_fix(report, note)

    plain = tmp_path / "plain.onnx"
    export(model, (x,), plain, precision="fp16")
    assert not verify(model, plain, (x,))  # the FP16 graph has no upcast: x^2 overflows

    kept = tmp_path / "kept.onnx"
    export(model, (x,), kept, precision="fp16", fp32_modules=["norm"])
    result = verify(model, kept, (x,))
    assert result, result.failures()
