"""INT8 in front of a recurrent op: the ranges of every tensor an LSTM reads, through the
convolutions before it, stay the calibration max, and the layers reading them get neither
a bias correction nor fitted weight codes (``_int8_search.recurrent_fed``, ``unfitted``). Ground truth: ONNX Runtime runs the written
Q/DQ file as written against the FP32 graph, on words the calibration never saw."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
import int8_zoo  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from zoo_real import Missing  # noqa: E402


def _crnn(path) -> str:
    """x (T, 1, 4) -> Gemm -> Relu -> LSTM (8) -> Gemm: a recurrent op behind a layer."""
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array(rng.normal(0, 0.5, shape).astype(np.float32), name)

    g = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "flat"], ["x2"]),
            helper.make_node("Gemm", ["x2", "w1", "b1"], ["h"], transB=1),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Reshape", ["r", "seq"], ["r3"]),
            helper.make_node("LSTM", ["r3", "W", "R", "B"], ["y"], hidden_size=8),
            helper.make_node("Reshape", ["y", "flat8"], ["y2"]),
            helper.make_node("Gemm", ["y2", "w2", "b2"], ["z"], transB=1),
        ],
        "crnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [12, 1, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [12, 5])],
        [
            numpy_helper.from_array(np.array([12, 4], np.int64), "flat"),
            numpy_helper.from_array(np.array([12, 1, 16], np.int64), "seq"),
            numpy_helper.from_array(np.array([12, 8], np.int64), "flat8"),
            init("w1", 16, 4),
            init("b1", 16),
            init("W", 1, 32, 16),
            init("R", 1, 32, 8),
            init("B", 1, 64),
            init("w2", 5, 8),
            init("b2", 5),
        ],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_what_an_lstm_reads_is_found_through_the_layers_before_it(tmp_path):
    from fp16lens.export._int8_search import recurrent_fed

    graph = onnx.load(_crnn(tmp_path / "crnn.onnx")).graph
    assert recurrent_fed(graph, ["x", "x2", "h", "r", "r3", "y", "y2", "z"]) == [
        "x",
        "x2",
        "h",
        "r",
        "r3",
    ]  # not the LSTM's output, nor what reads it


def test_ddddocr_int8_keeps_the_max_and_no_fit_before_its_lstm():
    """ddddocr's OCR as its wheel ships it (convolutions, an LSTM, a Gemm over 8210
    characters), calibrated on 8 captcha-like words: every range in front of the LSTM is
    the calibration max and no conv there is bias-corrected or refitted, and on 24 other
    words the written file reads 23 as FP32 does, cosine >= 0.995. Before (clips chosen on
    the 2 probe words): 22 and 0.9912."""
    from fp16lens.export._int8_search import recurrent_fed

    try:
        case = int8_zoo.ddddocr(8, 24)
    except Missing as exc:
        pytest.skip(str(exc))
    proto, plan, got = int8_zoo.searched(case)
    fed = set(recurrent_fed(proto.graph, list(plan.scales)))
    assert len(fed) >= 20 and {plan.methods[t] for t in fed} == {"max"}, plan.methods
    convs = [u for u in plan.units if fed.intersection(u.acts)]
    assert not {u.node for u in convs}.intersection(plan.corrections), plan.corrections
    assert convs and not {u.weight for u in convs}.intersection(plan.rounded), plan.rounded
    assert got["same string"] >= 23 / 24 and got["cosine"] >= 0.995, got
