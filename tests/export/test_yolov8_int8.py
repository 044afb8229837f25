"""NudeNet's YOLOv8n in INT8: its DFL softmax at the calibration max and its DFL conv's
weights stored exactly (the rules of ``tests/export/test_int8_exact.py`` on the trained
detector). In the main suite beside the other INT8 tests of whole shipped models
(``test_recurrent_int8.py``, ``test_loop_decoder_int8.py``): the INT8 lane of
``scripts/bootstrap.sh test`` runs the torch matrix after its own tests, so the longest
tests sit where the two lanes end together.

Ground truth: ONNX Runtime runs the written Q/DQ file as written (each Q/DQ on its own)
against the FP32 graph."""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
import int8_zoo  # noqa: E402
from zoo_real import Missing  # noqa: E402


@pytest.mark.slow
def test_yolov8_int8_keeps_its_boxes():
    """NudeNet's YOLOv8n as its wheel ships it: its DFL conv is stored exactly and reads
    its softmax at the calibration max, and INT8 keeps FP32's detections and their boxes
    on the evaluation items, where ONNX Runtime's Q/DQ on every op keeps none (one scale
    for the output's boxes in pixels and its class scores)."""
    from fp16lens.export._int8 import _quantize_ort, prepared

    try:
        case = int8_zoo.yolo(4, 6)
    except Missing as exc:
        pytest.skip(str(exc))
    _, plan, got = int8_zoo.searched(case, search_batches=1)
    assert plan.methods["/model.22/dfl/Softmax_output_0"] == "max"
    assert "model.22.dfl.conv.weight" not in plan.rounded
    refs = int8_zoo.run_outputs(case.path, case.eval)
    before = _quantize_ort(prepared(onnx.load(case.path)), list(case.cal), [])
    old = case.metric(refs, int8_zoo.run_outputs(before, case.eval))
    assert got["detections"] >= 4 and old["detection F1"] == 0.0, (got, old)
    assert got["detection F1"] >= 0.85 and got["box IoU"] >= 0.93, got
