"""The share of FLOPs a plan keeps in INT8 counts the work of every calibration batch: a
model calibrated on images of several sizes (the seal detector's stamps, text lines of
several widths) does most of its work on the large ones, and a layer after a global pool
does the same work on every size."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def _pooled_model():
    """x (1, 3, H, W) -> 3x3 Conv to 8 channels -> Relu -> GlobalAveragePool -> Flatten ->
    Gemm to 512: the conv's work grows with H*W, the Gemm's does not."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(8, np.float32), "b")
    g = numpy_helper.from_array(rng.normal(size=(512, 8)).astype(np.float32), "g")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
            helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
            helper.make_node("Gemm", ["f", "g"], ["y"], name="gemm", transB=1),
        ],
        "pooled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 512])],
        [w, b, g],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_int8_flops_share_counts_every_calibration_batch_at_its_own_size():
    """Calibrated on a 4x4 and a 64x64 image, the conv does 216 multiply-adds per pixel
    (8 channels of 3x3x3) on both, 3456 + 884736, and the Gemm 4096 on each: with the Gemm
    kept out, 99.1% of the FLOPs stay in INT8. Before, the count took the first batch's
    shapes alone and said 45.8%."""
    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._int8_search import search

    proto = prepared(_pooled_model())
    name_nodes(proto.graph)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.normal(size=(1, 3, s, s)).astype(np.float32)} for s in (4, 64)]
    plan = search(proto, feeds, correct_bias=False, equalize=False, centre=False)
    flops = {u.node: u.flops for u in plan.units}
    assert flops == {"conv": 216 * (4 * 4 + 64 * 64), "gemm": 2 * 512 * 8}
    assert plan.int8_flop_share == 1.0
    gemm_out = dataclasses.replace(plan, on=[u.node != "gemm" for u in plan.units])
    assert gemm_out.int8_flop_share == pytest.approx(888192 / (888192 + 8192))
