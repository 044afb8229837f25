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
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

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


def test_the_grid_is_the_fewest_levels_the_whole_channel_fits():
    """``exact_levels`` tries every grid on a channel's first values at once, then the whole
    channel: a channel whose first values fit a coarser grid than the rest (here zeros,
    then halves, then a third) gets the grid of all its values, and each channel the
    fewest levels a brute-force search over every value finds."""
    from fp16lens.export._int8_search import QMAX, _channels, exact_levels

    rng = np.random.default_rng(1)
    late = np.zeros(40, np.float32)
    late[20], late[30], late[39] = 1.0, 0.5, 1.0 / 3.0  # steps of 1/6 only from value 39 on
    halves = np.zeros(40, np.float32)
    halves[12], halves[25] = 1.0, -0.5  # 2 levels, seen past the first 8 values
    rows = np.stack(
        [
            late,
            halves,
            (np.arange(40) % 16).astype(np.float32),  # YOLOv8's DFL bins: 15 levels
            rng.normal(size=40).astype(np.float32),  # a trained weight's channel: 127
            np.zeros(40, np.float32),  # a dead channel: 127, nothing to store
        ]
    )
    rows, amax = _channels(rows, 0)

    def fewest(row, top):
        for m in range(1, int(QMAX)):
            x = row / top * m
            if top > 0 and np.abs(x - np.rint(x)).max() <= 1e-5:
                return m
        return QMAX

    assert exact_levels(rows, amax).tolist() == [6, 2, 15, QMAX, QMAX]
    assert exact_levels(rows, amax).tolist() == [fewest(r, t) for r, t in zip(rows, amax)]
