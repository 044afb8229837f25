"""INT8 from one calibration batch (``fp16lens export model.onnx --precision int8 --input
cal.npz``): where the graph's first axis is the batch, the batch is split, so the
corrections that need batches to fit on and others to check on are tried; where it is not
(a sequence along the first axis, a fixed batch), it stays one batch."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import int8_zoo  # noqa: E402

NOT_TRIED = "not tried: it needs two calibration batches or more"


def _quantize(proto, calibration):
    from fp16lens.export._int8 import prepared, quantize_fp16lens
    from fp16lens.export._int8_place import name_nodes

    proto = prepared(proto)
    name_nodes(proto.graph)
    return quantize_fp16lens(proto, calibration)


def _free_first_axis(proto):
    for v in [*proto.graph.input, *proto.graph.output]:
        v.type.tensor_type.shape.dim[0].dim_param = "N"
    return proto


def test_one_batch_of_trained_pnet_is_split_as_its_items():
    """MTCNN PNet (facenet-pytorch's trained weights) with a free batch axis, calibrated
    with its 8 calibration crops as one batch: split into 8, the search keeps both
    corrections and writes the same INT8 file as from the 8 crops given one by one (the
    run the bench measures); before, one batch left both corrections untried."""
    try:
        case = int8_zoo.MODELS["pnet"](8, 24)
    except int8_zoo.Missing as exc:
        pytest.skip(str(exc))
    proto = _free_first_axis(onnx.load(case.path))
    name = next(iter(case.cal[0]))
    whole = {name: np.concatenate([item[name] for item in case.cal])}
    quantized, plan = _quantize(onnx.ModelProto.FromString(proto.SerializeToString()), [whole])
    assert plan.notes[0].startswith("the calibration batch of 8 items split into 8 batches")
    assert not any(NOT_TRIED in n for n in plan.notes), plan.notes
    assert plan.rounded and plan.corrections, plan.notes
    one_by_one, _ = _quantize(proto, list(case.cal))
    got = {i.name: onnx.numpy_helper.to_array(i) for i in quantized.graph.initializer}
    want = {i.name: onnx.numpy_helper.to_array(i) for i in one_by_one.graph.initializer}
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in want)


def _sequence_model(first: int | str):
    """x (T, 4) -> CumSum over T -> MatMul -> Relu -> MatMul: the first axis is time."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(4, 8)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(8, 3)).astype(np.float32), "w2")
    axis = numpy_helper.from_array(np.array(0, np.int64), "axis")
    graph = helper.make_graph(
        [
            helper.make_node("CumSum", ["x", "axis"], ["c"], name="cumsum"),
            helper.make_node("MatMul", ["c", "w1"], ["h"], name="mm1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        ],
        "seq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [first, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [first, 3])],
        [w1, w2, axis],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("first", ["T", 16], ids=["a sequence", "a fixed batch"])
def test_one_batch_stays_whole_where_its_first_axis_is_not_a_free_batch(first):
    """A running sum along the first axis gives other outputs on the parts than on the
    whole, and a first axis of fixed size cannot take parts: the batch stays one, and the
    plan says why the corrections were not tried."""
    x = np.random.default_rng(1).normal(size=(16, 4)).astype(np.float32)
    _, plan = _quantize(_sequence_model(first), [{"x": x}])
    assert not any("split into" in n for n in plan.notes), plan.notes
    assert sum(NOT_TRIED in n for n in plan.notes) == 2, plan.notes
