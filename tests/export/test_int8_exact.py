"""INT8 where a clip or a rounding would move what a layer decides: a softmax's range is its
calibration max, and a weight on a coarse grid is stored exactly (YOLOv8's DFL: a softmax
over 16 bins read by a conv with the weights 0, 1, ..., 15).

Ground truth: ONNX Runtime runs the written Q/DQ file as written (each Q/DQ on its own)
against the FP32 graph."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
import int8_zoo  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from zoo_real import Missing  # noqa: E402

BINS, N, EVERY = 16, 512, 256


def _dfl(path) -> str:
    """logits (1, 16, 1, N) -> Softmax over the bins -> Conv with weights 0..15: each
    position's expected bin, the distance YOLOv8's head reads."""
    w = numpy_helper.from_array(np.arange(BINS, dtype=np.float32).reshape(1, BINS, 1, 1), "w")
    g = helper.make_graph(
        [
            helper.make_node("Softmax", ["x"], ["p"], axis=1),
            helper.make_node("Conv", ["p", "w"], ["y"]),
        ],
        "dfl",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, BINS, 1, N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 1, N])],
        [w],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def _logits(seed: int) -> dict:
    """Most positions nearly flat (background anchors), few peaked on a bin and its
    neighbour (an object's box edge): one in 256 positions."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 0.3, (1, BINS, 1, N)).astype(np.float32)
    for j in range(0, N, EVERY):
        b = int(rng.integers(1, BINS - 1))
        x[0, b, 0, j] += 5.0
        x[0, b + 1, 0, j] += float(rng.uniform(3.0, 5.0))
    return {"x": x}


def test_a_softmax_keeps_its_peaks_and_the_dfl_weights_stay_exact(tmp_path):
    import onnxruntime as ort

    from fp16lens.export import export

    path = _dfl(tmp_path / "dfl.onnx")
    cal = [_logits(s) for s in range(4)]
    art = export(path, None, tmp_path / "dfl8.onnx", precision="int8", calibration=cal)
    out = onnx.load(str(art.path))
    made = {o: n for n in out.graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    wdq, xdq = made[conv.input[1]], made[conv.input[0]]
    codes, scale = inits[wdq.input[0]], inits[wdq.input[1]]
    assert codes.ravel().tolist() == list(range(BINS)) and scale.ravel().tolist() == [1.0]

    fp32 = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    peak = max(float(_softmax(c["x"]).max()) for c in cal)
    assert float(inits[xdq.input[1]]) == pytest.approx(peak / 127, rel=1e-6)
    # the softmax's 99.9th percentile sits in the flat positions' mass: a clip there
    assert np.percentile(np.concatenate([_softmax(c["x"]).ravel() for c in cal]), 99.9) < peak / 2

    # INT8 as written against the FP32 graph at the peaked positions, and against the same
    # softmax clipped at its 99.9th percentile (computed here, exact weights)
    clip = float(np.percentile(np.concatenate([_softmax(c["x"]).ravel() for c in cal]), 99.9))
    written = ort.InferenceSession(str(art.path), providers=["CPUExecutionProvider"])
    peaked = np.arange(0, N, EVERY)
    for seed in (10, 11):
        feed = _logits(seed)
        ref, got = fp32.run(None, feed)[0][0, 0, 0], written.run(None, feed)[0][0, 0, 0]
        p = _softmax(feed["x"])[0, :, 0]
        step = clip / 127
        clipped = (np.clip(np.rint(p / step), -127, 127) * step * np.arange(BINS)[:, None]).sum(0)
        ours, theirs = np.abs(got - ref)[peaked], np.abs(clipped - ref)[peaked]
        assert ours.max() < 1.0 and (3 * ours < theirs).all(), (ours, theirs)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_quantize_weight_stores_a_grid_exactly_and_leaves_the_rest():
    from fp16lens.export._int8_search import quantize_weight

    rng = np.random.default_rng(0)
    w = np.stack([np.array([0.5, -0.25, 0.75, 0.0]), rng.normal(size=4)]).astype(np.float32)
    codes, scale = quantize_weight(w, 0)
    assert codes[0].tolist() == [2, -1, 3, 0] and scale[0] == 0.25  # exact
    assert scale[1] == pytest.approx(np.abs(w[1]).max() / 127)  # 127 levels, as before
    assert np.abs(codes[1] * scale[1] - w[1]).max() <= scale[1] / 2
    _, one = quantize_weight(w[1], None)  # per tensor
    assert one.shape == () and one == pytest.approx(np.abs(w[1]).max() / 127)


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
