"""An FP16 export checks the file it wrote in real FP16 on the example inputs (FP16 storage
of every tensor, verify's ``onnx-fp16``): the demo model, which overflows, gets a failed
``artifact.parity`` and a warning naming where (and `fp16lens export` exits 1); its patched
form passes. Ground truth: the models' own ``.half()``, without fp16lens."""

from __future__ import annotations

import copy
import json
import re

import torch

import fp16lens
from fp16lens.cli import main
from fp16lens.demo import build_demo_model
from fp16lens.export import export


def _half_finite(model, x) -> bool:
    with torch.no_grad():
        return bool(torch.isfinite(copy.deepcopy(model).half()(x.half())).all())


def test_an_fp16_file_that_overflows_says_so_and_its_patched_form_passes(tmp_path):
    model, (x,) = build_demo_model()
    assert not _half_finite(model, x)  # ground truth: real FP16 overflows
    art = export(model, (x,), tmp_path / "demo.onnx", "fp16")
    assert art.parity is not None and not art.parity.passed and art.parity.nonfinite
    (note,) = [w for w in art.warnings if "fails in real FP16" in w]
    # dynamo keeps the batch norm; TorchScript (torch < 2.5) folds it into conv2
    assert re.search(r"first at backbone\.layer4\.1\.(bn2|conv2)\b", note), note
    assert "fp16lens.patch" in note

    report = fp16lens.scan(model, [x], progress=False)
    patched = fp16lens.patch(model, report, batches=[x])
    assert _half_finite(patched, x)
    art = export(patched, (x,), tmp_path / "patched.onnx", "fp16")
    assert art.parity.passed and art.parity.cosine >= 0.999
    assert not any("real FP16" in w for w in art.warnings)


def test_the_command_exits_1_on_a_file_that_fails_its_fp16_check(tmp_path, capsys):
    out = tmp_path / "demo.onnx"
    assert main(["export", "demo", "-o", str(out), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fp16_check"]["passed"] is False and data["fp16_check"]["nonfinite"]
    assert out.exists()  # written, and said to fail
    assert main(["export", "demo", "-o", str(out)]) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert "`fp16lens scan`, then `fp16lens patch`" in text and "--fp32-modules" in text
    assert "export(..." not in text


def test_an_onnx_source_is_checked_on_its_evaluation_batches_or_says_it_was_not(tmp_path):
    """An FP32 ONNX file has no example inputs: without ``evaluation`` the FP16 export says
    it was not checked; with them it is, against the FP32 file."""
    from fp16lens.export._export import UNCHECKED

    model, (x,) = build_demo_model()
    src = tmp_path / "demo32.onnx"
    export(model, (x,), src, "fp32")
    art = export(src, None, tmp_path / "a.onnx", "fp16")
    assert art.parity is None and UNCHECKED in art.warnings
    art = export(src, None, tmp_path / "b.onnx", "fp16", evaluation=[(x.numpy(),)])
    assert not art.parity.passed and art.parity.nonfinite and UNCHECKED not in art.warnings
    assert main(["export", str(src), "-o", str(tmp_path / "c.onnx"), "--json"]) == 0


def test_an_onnx_source_of_batch_one_is_checked_item_by_item(tmp_path):
    """One evaluation batch of 3 items for a graph exported with batch 1: the check runs
    on each item (it used to fail to run and say the file was not checked), and a failure
    says how the batch was split. Ground truth: the demo model's own .half() per item."""
    model, (x,) = build_demo_model()
    assert x.shape[0] == 1
    src = tmp_path / "demo32.onnx"
    export(model, (x,), src, "fp32")
    three = torch.cat([x, x * 0.5, x * 2.0])
    assert not all(_half_finite(model, item[None]) for item in three)  # real FP16 overflows
    art = export(src, None, tmp_path / "b.onnx", "fp16", evaluation=[(three.numpy(),)])
    assert art.parity is not None and not art.parity.passed and art.parity.nonfinite
    assert art.parity.batches == 3
    (note,) = [w for w in art.warnings if "fails in real FP16" in w]
    assert "(the batch of 3 items split into its items (the graph's first axis is 1))" in note
    assert not any("not run in real FP16" in w for w in art.warnings)


def test_a_subnormal_weight_warning_says_what_the_check_saw(tmp_path):
    # fc2's weights are all subnormal in FP16 (about 1e-6): each output channel loses up to
    # 0.8% of its magnitude, more than FP16's own rounding, so the export warns; its own
    # check on the example inputs passes, and the warning says so next to "may change"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(3e4)
        model[0].bias.mul_(3e4)
        model[2].weight.div_(3e4)
    model.eval()
    x = torch.rand(2, 8) + 0.5
    with torch.no_grad():  # ground truth: the model's own .half() keeps the output
        got = copy.deepcopy(model).half()(x.half()).float()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), model(x).flatten(), 0)
    assert cos > 0.999
    art = export(model, (x,), tmp_path / "m.onnx", "fp16")
    assert art.parity.passed
    (warning,) = [w for w in art.warnings if "subnormal" in w]
    assert (
        "which may change the output (not on the example inputs: the FP16 file's check" in warning
    )
    assert "(64 of 64 values subnormal, none of them 0 in FP16)" in warning
