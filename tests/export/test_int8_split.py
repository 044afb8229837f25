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


def _pnet():
    try:
        return int8_zoo.MODELS["pnet"](8, 24)
    except int8_zoo.Missing as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("free", [True, False], ids=["a free batch axis", "one item at a time"])
def test_one_batch_of_trained_pnet_is_split_as_its_items(free):
    """MTCNN PNet (facenet-pytorch's trained weights), calibrated with its 8 calibration
    crops as one batch, on a graph with a free batch axis or one that takes one crop at a
    time (as exported): split into 8, the search keeps both corrections and writes the same
    INT8 file as from the 8 crops given one by one (the run the bench measures). Before,
    one batch left both corrections untried, or ONNX Runtime refused it."""
    case = _pnet()
    proto = onnx.load(case.path)
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1
    if free:
        proto = _free_first_axis(proto)
    name = next(iter(case.cal[0]))
    whole = {name: np.concatenate([item[name] for item in case.cal])}
    quantized, plan = _quantize(onnx.ModelProto.FromString(proto.SerializeToString()), [whole])
    assert plan.notes[0].startswith("the calibration batch of 8 items split into")
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
    plan says why the corrections were not tried, and, where the axis is free, why it was
    not split (openwakeword's mel spectrogram is in dB below the batch's max)."""
    x = np.random.default_rng(1).normal(size=(16, 4)).astype(np.float32)
    _, plan = _quantize(_sequence_model(first), [{"x": x}])
    assert not any("split into" in n for n in plan.notes), plan.notes
    assert sum(NOT_TRIED in n for n in plan.notes) == 2, plan.notes
    whole = [n for n in plan.notes if "kept whole" in n]
    if first == "T":
        assert whole == [
            "the calibration batch of 16 items kept whole: the FP32 graph computes other values "
            "on parts of it (its outputs mix the items, as a spectrogram in dB below the "
            "batch's max does), so the corrections need it given as several batches"
        ], plan.notes
    else:
        assert whole == [], plan.notes


def test_a_batch_the_graph_cannot_take_is_one_line(tmp_path, capsys):
    """A calibration file of 48x48 crops for PNet's 96x96 graph: exit 2, one line naming
    the input, both shapes and the fix, no traceback."""
    from fp16lens.cli import main

    case = _pnet()
    cal = tmp_path / "cal.npz"
    np.savez(cal, x=np.zeros((8, 3, 48, 48), np.float32))
    argv = ["export", case.path, "-o", str(tmp_path / "q.onnx"), "--precision", "int8"]
    assert main([*argv, "--input", str(cal)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "has shape 8x3x48x48 where the graph takes 1x3x96x96" in err, err


def test_a_first_axis_declared_minus_one_is_free(tmp_path):
    """rapidocr's PP-OCR v2.0 text-line classifier declares its input -1x3x?x? (-1 for a
    free axis, as some exporters write it): a batch of one item was refused ("where the
    graph takes -1x3x?x?"); it is a free axis, and the export and its check run."""
    from onnx import TensorProto, helper, numpy_helper

    from fp16lens.export import export

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], name="conv")],
        "minus_one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1, -1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4, -1, -1])],
        [w],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    items = [{"x": rng.normal(size=(1, 3, 8, 8)).astype(np.float32)} for _ in range(6)]
    art = export(
        str(path), None, tmp_path / "q.onnx", "int8", calibration=items[:4], evaluation=items[4:]
    )
    assert art.parity is not None and art.parity.passed and art.parity.batches == 2
