"""INT8: explicit Q/DQ for TensorRT, calibrated in ONNX Runtime, and its TensorRT cache."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from models import clean

pytest.importorskip("onnxscript")


def _batches(shape, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(shape, generator=g),) for _ in range(n)]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    from fp16lens.export import export

    model, (x,) = clean()
    return export(model, (x,), tmp_path_factory.mktemp("int8") / "clean.onnx", "fp32"), model, x


@pytest.fixture(scope="module")
def int8(fp32):
    """The FP32 export quantized (export(..., "int8") runs the same step after exporting)."""
    from fp16lens.export import retype

    art, model, x = fp32
    path = art.path.with_name("clean_int8.onnx")
    calibration = _batches(x.shape, 16, seed=11)
    return retype(art.path, path, "int8", calibration=calibration), model, x


def _initializers(ox, model):
    return {i.name: ox.onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def test_qdq_in_the_form_tensorrt_reads(int8, ox):
    art, _, _ = int8
    model = ox.onnx.load(str(art.path))
    consts = _initializers(ox, model)
    producer = {o: n for n in model.graph.node for o in n.output}
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert quantize
    for q in quantize:  # symmetric INT8 activations: zero point 0, one scale per tensor
        assert consts[q.input[2]].dtype == np.int8 and not consts[q.input[2]].any()
        assert consts[q.input[1]].size == 1
    for conv in (n for n in model.graph.node if n.op_type in ("Conv", "Gemm")):
        data, weight = (producer[conv.input[i]] for i in (0, 1))
        assert data.op_type == weight.op_type == "DequantizeLinear", conv.name
        w, scale = consts[weight.input[0]], consts[weight.input[1]]
        assert w.dtype == np.int8 and scale.size == w.shape[0]  # per output channel
        assert not consts[weight.input[2]].any()  # symmetric weights
        assert conv.input[2] in consts and consts[conv.input[2]].dtype == np.float32
    assert not any(a.dtype == np.int32 for a in consts.values())  # no INT32 bias DQ
    ox.onnx.checker.check_model(model, full_check=True)


def test_int8_output_matches_fp32_on_the_calibration_distribution(int8, ox):
    art, model, x = int8
    # Basic optimizations keep the Q/DQ nodes as explicit fake quantization, what the graph
    # means and TensorRT computes (INT32 accumulation). ORT's fused INT8 CPU kernels are
    # not used: on AVX2 without VNNI they saturate (VPMADDUBSW), an ORT CPU artefact.
    level = ox.ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    tests = [b for (b,) in _batches(x.shape, 16, seed=12)]
    got = np.concatenate(
        [ox.run(art.path, {"x": t.numpy()}, level=level)["output"] for t in tests]
    )  # named by export
    with torch.no_grad():
        want = torch.cat([model(t) for t in tests]).numpy()
    cosine = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    assert cosine >= 0.99
    assert not np.array_equal(got, want)  # it is quantized


def test_tensorrt_cache_holds_the_models_scales(int8, fp32, ox):
    from fp16lens.export import read_calibration_cache

    art, _, _ = int8
    model = ox.onnx.load(str(art.path))
    consts = _initializers(ox, model)
    header = art.calibration_cache.read_text().splitlines()[0]
    assert re.fullmatch(r"TRT-\d+-EntropyCalibration2", header)
    cache = read_calibration_cache(art.calibration_cache)
    suffix = "_QuantizeLinear_Input"  # ORT's name for a quantized graph output
    want = {
        q.input[0].removesuffix(suffix): float(consts[q.input[1]])
        for q in model.graph.node
        if q.op_type == "QuantizeLinear"
    }
    assert cache == want  # exact: float32 bits round-trip through the hex
    # the names are the FP32 graph's tensors: the cache also serves a weakly typed build
    fp32_graph = ox.onnx.load(str(fp32[0].path)).graph
    assert set(cache) <= {"x", *(o for n in fp32_graph.node for o in n.output)}


def test_island_stays_unquantized(tmp_path, ox):
    from fp16lens.export import export

    model, (x,) = clean()
    art = export(
        model,
        (x,),
        tmp_path / "q.onnx",
        "int8",
        fp32_modules=["fc"],
        calibration=_batches(x.shape, 4, seed=13),
    )
    onnx_model = ox.onnx.load(str(art.path))
    producer = {o: n for n in onnx_model.graph.node for o in n.output}
    (gemm,) = [n for n in onnx_model.graph.node if n.op_type == "Gemm"]
    assert art.node_map[gemm.name] == "fc"
    assert all(i not in producer or producer[i].op_type != "DequantizeLinear" for i in gemm.input)
    assert any(n.op_type == "QuantizeLinear" for n in onnx_model.graph.node)  # the rest is INT8


def test_calibration_batches_must_match_the_inputs():
    from fp16lens.export import ExportError
    from fp16lens.export._int8 import batch_feed

    feed = batch_feed((torch.ones(1, 3),), ["x"])
    assert feed["x"].dtype == np.float32 and feed["x"].shape == (1, 3)
    with pytest.raises(ExportError, match="2 tensor"):
        batch_feed((torch.ones(1), torch.ones(1)), ["x"])


def test_int8_without_calibration_is_refused():
    from fp16lens.export import ExportError, export

    model, inputs = clean()
    with pytest.raises(ExportError, match="calibration="):
        export(model, inputs, "unused.onnx", "int8")


def test_the_cache_note_names_what_only_the_qdq_file_carries():
    """A plan that rewrote nothing of the FP32 graph is carried whole by the cache (no
    note); each rewrite is named with its count, and the cache by its file name."""
    import dataclasses

    import onnx

    from fp16lens.export._int8 import _cache_leaves_out
    from fp16lens.export._int8_search import Int8Plan

    plain = Int8Plan(units=[], scales={"x": 0.1}, methods={"x": "max"}, on=[])
    graph = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    assert _cache_leaves_out(plain, "m.cache", graph) == []
    rewrote = Int8Plan(
        units=[],
        scales={"x": 0.1},
        methods={"x": "max"},
        on=[],
        rounded={"w1": None, "w2": None},
        corrections={"conv": None},
        equalized=["conv"],
    )
    (note,) = _cache_leaves_out(rewrote, "m.cache", graph)
    assert note.startswith("the TensorRT 10 calibration cache m.cache holds only the activation")
    made = (
        "the fitted codes of 2 weights, the bias corrections of 1 layer and the scale "
        "migration before 1 layer made here"
    )
    assert made in note, note
    assert "centring" not in note and "encoding" not in note and "grid" not in note
    # a weight stored exactly on a grid of 16 steps (YOLOv8's DFL conv): TensorRT's own
    # rounding from the FP32 graph (127 steps) would not keep it
    from fp16lens.export._int8_place import Unit

    dfl = np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1)
    graph.graph.initializer.append(onnx.numpy_helper.from_array(dfl, "w"))
    exact = Int8Plan(
        units=[Unit("c", "Conv", ("p",), "w", 0, 16)], scales={}, methods={}, on=[True]
    )
    (note,) = _cache_leaves_out(exact, "m.cache", graph)
    assert "it does not carry the exact grid of 1 weight made here" in note, note
    assert _cache_leaves_out(dataclasses.replace(exact, on=[False]), "m.cache", graph) == []
