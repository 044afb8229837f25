"""export() of an FP32 ONNX file (no PyTorch source): strongly typed FP16 with the FP32
islands a patched file records, and INT8 Q/DQ calibrated on batches.

Ground truth: real FP16 in torch (``copy.deepcopy(model).half()``) for the models the
files were exported from, and verify's faithful ``onnx-fp16`` backend (every stored
tensor rounded to FP16) for the typed graphs.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zoo_real

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens._core import ExportError  # noqa: E402
from fp16lens._core.fingerprint import onnx_changed, onnx_fingerprint  # noqa: E402
from fp16lens.export import export, read_calibration_cache  # noqa: E402

import models  # noqa: E402

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def to_onnx(model, inputs, path, opset: int = 17) -> str:
    """The FP32 file a user receives (TorchScript exporter: node names /fc1/Gemm)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, str(path), opset_version=opset, dynamo=False)
    return str(path)


def real_half(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).half()(*[t.half() for t in inputs]).float()


def plain_ort(path):
    """The file in ONNX Runtime as anybody loads it (CPU, default optimizations)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def elem_types(path) -> dict[str, int]:
    g = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types.update({i.name: i.data_type for i in g.initializer})
    return types


def with_metadata(path, out, key: str, value: str) -> str:
    proto = onnx.load(str(path))
    entry = proto.metadata_props.add()
    entry.key, entry.value = key, value
    onnx.save(proto, str(out))
    return str(out)


@pytest.fixture(scope="module")
def clean_file(tmp_path_factory):
    model, inputs = models.clean()
    return model, inputs, to_onnx(model, inputs, tmp_path_factory.mktemp("in") / "clean.onnx", 13)


@pytest.fixture(scope="module")
def gelu_file(tmp_path_factory):
    model, inputs = models.gelu_span()
    return model, inputs, to_onnx(model, inputs, tmp_path_factory.mktemp("in") / "gelu.onnx")


def test_fp16_file_is_strongly_typed_and_runs_like_real_fp16(clean_file, tmp_path):
    model, inputs, path = clean_file
    art = export(path, None, tmp_path / "c16.onnx", precision="fp16")
    assert art.precision == "fp16" and art.exporter == "onnx" and not art.fp32_nodes
    proto = onnx.load(str(art.path))
    onnx.checker.check_model(proto, full_check=True)
    floats = [i for i in proto.graph.initializer if i.data_type in (F32, F16)]
    assert floats and all(i.data_type == F16 for i in floats)
    types = elem_types(art.path)
    x, y = proto.graph.input[0].name, proto.graph.output[0].name
    assert types[x] == types[y] == F32  # the boundary keeps FP32, Casts inside
    compute = [o for n in proto.graph.node if n.op_type != "Cast" for o in n.output]
    assert compute and all(types[o] == F16 for o in compute)
    (got,) = zoo_real.onnx_fp16_file_real(str(art.path), {x: inputs[0].numpy()}).values()
    want = real_half(model, inputs)
    cos = torch.nn.functional.cosine_similarity(torch.from_numpy(got).flatten(), want.flatten(), 0)
    assert cos > 0.9999
    assert fp16lens.verify(path, art.path, inputs)  # clean model, clean verdict


def test_islands_recorded_by_patch_keep_a_span_fp32_and_fix_it(gelu_file, tmp_path):
    model, inputs, path = gelu_file
    assert not torch.isfinite(real_half(model, inputs)).all()  # real FP16 overflows
    report = fp16lens.scan(path, [inputs[0]], progress=False)
    (span,) = report.spans
    plain = export(path, None, tmp_path / "plain16.onnx")
    failed = fp16lens.verify(path, plain.path, inputs)
    assert not failed and failed.nonfinite  # the faithful FP16 graph overflows too
    patched = with_metadata(
        path, tmp_path / "patched.onnx", "fp16lens.fp32_nodes", json.dumps(list(span.sites))
    )
    art = export(patched, None, tmp_path / "fixed16.onnx")
    assert set(span.sites) <= set(art.fp32_nodes)
    types = elem_types(art.path)
    proto = onnx.load(str(art.path))
    for node in proto.graph.node:
        if node.name in span.sites:  # computes in FP32, fed and read through Casts
            assert all(
                types[t] == F32 for t in [*node.input, *node.output] if types.get(t) in (F32, F16)
            )
    assert fp16lens.verify(path, art.path, inputs, tolerance=0.9999)
    # the same islands named by the caller give the same graph
    same = export(path, None, tmp_path / "named16.onnx", fp32_nodes=list(span.sites))
    assert same.fp32_nodes == art.fp32_nodes
    assert [n.op_type for n in onnx.load(str(same.path)).graph.node] == [
        n.op_type for n in proto.graph.node
    ]


def _const(name: str, array) -> onnx.NodeProto:
    return helper.make_node(
        "Constant",
        [],
        [name],
        name=f"{name}_node",
        value=numpy_helper.from_array(np.asarray(array), name),
    )


def shape_ops_graph(path) -> str:
    """Resize with constant scales, ConstantOfShape without a value (float32 zeros by
    default: tv.swin's dynamo export has one), Range over float constants (no FP16 form),
    a Cast of a shape to float."""
    h = helper
    nodes = [
        _const("scales", np.array([1, 1, 2, 2], np.float32)),
        h.make_node("Resize", ["x", "", "scales"], ["up"], mode="nearest", name="resize"),
        h.make_node("Shape", ["up"], ["shape"], name="shape"),
        h.make_node("ConstantOfShape", ["shape"], ["zeros"], name="zeros"),
        h.make_node("Add", ["up", "zeros"], ["a"], name="add0"),
        _const("start", np.array(0.5, np.float32)),
        _const("limit", np.array(8.5, np.float32)),
        _const("delta", np.array(1.0, np.float32)),
        h.make_node("Range", ["start", "limit", "delta"], ["ramp"], name="range"),
        h.make_node("Add", ["a", "ramp"], ["b"], name="add1"),
        h.make_node("Cast", ["shape"], ["shape_f"], to=F32, name="cast"),
        h.make_node("ReduceSum", ["shape_f"], ["n"], keepdims=0, name="count"),
        h.make_node("Div", ["b", "n"], ["y"], name="div"),
    ]
    graph = h.make_graph(
        nodes,
        "shape_ops",
        [h.make_tensor_value_info("x", F32, [1, 2, 4, 4])],
        [h.make_tensor_value_info("y", F32, [1, 2, 8, 8])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return str(path)


def test_shape_scale_and_range_constants_keep_fp32_and_constantofshape_gets_an_fp16_value(tmp_path):
    path = shape_ops_graph(tmp_path / "ops.onnx")
    art = export(path, None, tmp_path / "ops16.onnx")  # checker full_check inside
    proto = onnx.load(str(art.path))
    nodes = {n.name: n for n in proto.graph.node}
    assert art.fp32_nodes == ("range",)
    assert any("Range" in w and "no float16 form" in w for w in art.warnings)
    for name in ("scales_node", "start_node", "limit_node", "delta_node"):  # read as FP32 only
        assert nodes[name].attribute[0].t.data_type == F32
    assert nodes["resize"].input[2] == "scales" and nodes["range"].input[:] == [
        "start",
        "limit",
        "delta",
    ]
    (value,) = [a for a in nodes["zeros"].attribute if a.name == "value"]
    assert value.t.data_type == F16  # the default float32 zero, spelled out in FP16
    types = elem_types(art.path)
    assert types["zeros"] == types["a"] == types["b"] == F16 and types["ramp"] == F32
    x = np.random.default_rng(0).random((1, 2, 4, 4), dtype=np.float32)
    (got,) = plain_ort(art.path).run(None, {"x": x})
    up = x.repeat(2, axis=2).repeat(2, axis=3)
    want = (up + np.arange(0.5, 8.5, dtype=np.float32)) / 19  # 1+2+8+8
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-3)
    assert fp16lens.verify(path, art.path, (x,))


def test_unnamed_nodes_get_the_names_scan_gives_their_sites(clean_file, tmp_path):
    _model, inputs, path = clean_file
    proto = onnx.load(path)
    for node in proto.graph.node:
        node.name = ""  # as paddle2onnx writes them
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, str(bare))
    report = fp16lens.scan(str(bare), [inputs[0]], progress=False)
    conv = next(s for s in report.sites if report.sites[s].op == "Conv")
    art = export(str(bare), None, tmp_path / "bare16.onnx", fp32_nodes=[conv])
    assert art.fp32_nodes == (conv,)
    names = {n.name for n in onnx.load(str(art.path)).graph.node}
    assert set(report.sites) <= names
    result = fp16lens.verify(str(bare), art.path, inputs)
    assert result and result.first_divergence is None


def test_int8_file_is_calibrated_qdq_and_keeps_islands_in_float(clean_file, tmp_path):
    _model, inputs, path = clean_file
    convs = [n.name for n in onnx.load(path).graph.node if n.op_type == "Conv"]
    name = onnx.load(path).graph.input[0].name
    calib = [{name: inputs[0].numpy()}, (torch.rand(1, 3, 16, 16),)]
    art = export(
        path, None, tmp_path / "c8.onnx", precision="int8", calibration=calib, fp32_nodes=[convs[0]]
    )
    proto = onnx.load(str(art.path))
    onnx.checker.check_model(proto, full_check=True)
    made = {o: n.op_type for n in proto.graph.node for o in n.output}
    node = next(n for n in proto.graph.node if n.name == convs[0])
    assert all(made.get(t) != "DequantizeLinear" for t in node.input)  # the island: float
    quantized = [n for n in proto.graph.node if n.op_type == "Conv" and n.name != convs[0]]
    assert quantized and all(made.get(n.input[1]) == "DequantizeLinear" for n in quantized)
    scales = read_calibration_cache(art.calibration_cache)
    assert scales and all(s > 0 for s in scales.values())
    result = fp16lens.verify(path, art.path, inputs)
    assert result.backend == "onnx-int8" and result and result.cosine > 0.99


def test_refusals_name_the_problem_and_the_fix(clean_file, tmp_path):
    model, inputs, path = clean_file
    with pytest.raises(ExportError, match="needs calibration"):
        export(path, None, tmp_path / "a.onnx", precision="int8")
    sizes = [(torch.rand(1, 3, 16, 16),), (torch.rand(1, 3, 16, 24),)]
    with pytest.raises(
        ExportError, match=r"1x3x16x24 \(batch 2 of 2\) where the graph takes 1x3x16x16"
    ):
        export(path, None, tmp_path / "a.onnx", precision="int8", calibration=sizes)
    conv = next(n.name for n in onnx.load(path).graph.node if n.op_type == "Conv")
    with pytest.raises(ExportError, match="Did you mean"):
        export(path, None, tmp_path / "a.onnx", fp32_nodes=[conv + "x"])
    with pytest.raises(ExportError, match="keeps its own opset"):
        export(path, None, tmp_path / "a.onnx", opset=18)
    with pytest.raises(ExportError, match="fp32_modules"):
        export(model, inputs, tmp_path / "a.onnx", fp32_nodes=[conv])
    half = export(path, None, tmp_path / "h.onnx").path
    with pytest.raises(ExportError, match="already holds FP16"):
        export(half, None, tmp_path / "a.onnx")
    bad = with_metadata(path, tmp_path / "bad.onnx", "fp16lens.fp32_nodes", "conv1,conv2")
    with pytest.raises(ExportError, match="not JSON"):
        export(bad, None, tmp_path / "a.onnx")
    with pytest.raises(ExportError, match="does not exist"):
        export(tmp_path / "missing.onnx", None, tmp_path / "a.onnx")
    assert not (tmp_path / "a.onnx").exists()


def test_scan_records_the_initializer_fingerprint_that_refuses_other_weights(clean_file, tmp_path):
    _model, inputs, path = clean_file
    report = fp16lens.scan(path, [inputs[0]], progress=False)
    proto = onnx.load(path)
    assert report.meta.weights == onnx_fingerprint(proto) != {}
    assert onnx_changed(report.meta.weights, proto) == []
    assert onnx_changed({}, proto) == []  # a report without fingerprint: nothing to check
    init = proto.graph.initializer[1]
    array = numpy_helper.to_array(init).copy()
    array.flat[0] *= 1.01
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    assert onnx_changed(report.meta.weights, proto) == [init.name]
    again = onnx.load(path)  # the same values in another order: the ramp sum tells
    init = again.graph.initializer[1]
    array = numpy_helper.to_array(init).copy()
    array.reshape(-1)[[0, 1]] = array.reshape(-1)[[1, 0]]
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    assert array.reshape(-1)[0] != array.reshape(-1)[1]
    assert onnx_changed(report.meta.weights, again) == [init.name]


def test_cli_exports_and_verifies_an_onnx_file(gelu_file, tmp_path, capsys):
    from fp16lens.cli import main

    _model, inputs, path = gelu_file
    name = onnx.load(path).graph.input[0].name
    np.savez(tmp_path / "in.npz", **{name: inputs[0].numpy()})
    npz = str(tmp_path / "in.npz")
    out = str(tmp_path / "g16.onnx")
    # the file overflows in real FP16: export writes it, checks it on --input and exits 1
    assert main(["export", path, "--precision", "fp16", "-o", out, "--input", npz]) == 1
    assert Path(out).is_file()
    assert main(["verify", path, out, "--backend", "onnx-fp16", "--input", npz]) == 1
    report = fp16lens.scan(path, [inputs[0]], progress=False)
    islands = ",".join(report.spans[0].sites)
    capsys.readouterr()
    assert main(["export", path, "-o", out, "--fp32-nodes", islands, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fp32_nodes"] == list(report.spans[0].sites)
    assert main(["verify", path, out, "--input", npz]) == 0
    int8 = str(tmp_path / "g8.onnx")
    assert main(["export", path, "--precision", "int8", "-o", int8]) == 2
    assert "needs calibration batches" in capsys.readouterr().err
    assert main(["export", path, "--precision", "int8", "-o", int8, "--input", npz]) == 0
    assert onnx.load(int8).graph.node and (tmp_path / "g8.cache").is_file()
    (tmp_path / "g8.cache").unlink()
    assert main(["export", path, "--precision", "int8", "-o", int8, "--calibration", npz]) == 0
    assert (tmp_path / "g8.cache").is_file()


@pytest.mark.slow
def test_swin_dynamo_export_is_a_valid_fp16_graph(tmp_path):
    """torchvision's Swin (the zoo's small config) exported by dynamo holds a ConstantOfShape
    without a value (float32 zeros by default) feeding FP16 ops: the FP16 file passes the
    full checker and runs as real FP16 does."""
    pytest.importorskip("onnxscript")
    import zoo

    torch.manual_seed(0)
    model, inputs = zoo.ZOO["tv.swin"]()
    fp32 = export(model, inputs, tmp_path / "swin32.onnx", precision="fp32")
    graph = onnx.load(str(fp32.path)).graph
    assert any(n.op_type == "ConstantOfShape" and not n.attribute for n in graph.node)
    art = export(str(fp32.path), None, tmp_path / "swin16.onnx")
    onnx.checker.check_model(onnx.load(str(art.path)), full_check=True)
    assert torch.isfinite(real_half(model, inputs)).all()
    assert fp16lens.verify(model, art.path, inputs)


def test_int8_of_an_opset12_file_with_weights_in_constant_nodes_is_per_channel(tmp_path):
    """paddle2onnx writes every weight as a Constant node, at opset 11/12: ONNX Runtime
    would calibrate those as activations (one scale per tensor), and per-channel
    DequantizeLinear needs opset 13. The export moves them to initializers and converts
    the opset, so each conv weight gets one scale per output channel."""
    model, inputs = models.clean()
    proto = onnx.load(to_onnx(model, inputs, tmp_path / "c12.onnx", 12))
    for init in list(proto.graph.initializer):
        proto.graph.node.insert(0, helper.make_node("Constant", [], [init.name], value=init))
    del proto.graph.initializer[:]
    path = tmp_path / "constants.onnx"
    onnx.save(proto, str(path))
    batches = [(torch.rand(1, 3, 16, 16),) for _ in range(4)]
    art = export(str(path), None, tmp_path / "c8.onnx", precision="int8", calibration=batches)
    out = onnx.load(str(art.path))
    assert art.opset == 13 and not [
        n
        for n in out.graph.node
        if n.op_type == "Constant"
        and n.attribute[0].t.data_type == F32
        and len(n.attribute[0].t.dims) > 1
    ]
    made = {o: n for n in out.graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    convs = [n for n in out.graph.node if n.op_type == "Conv"]
    assert convs
    for conv in convs:
        dq = made[conv.input[1]]
        assert dq.op_type == "DequantizeLinear"
        channels = inits[dq.input[0]].shape[0]  # the INT8 weight
        assert inits[dq.input[1]].shape == (channels,)  # one scale per output channel
    result = fp16lens.verify(str(path), art.path, inputs)
    assert result.backend == "onnx-int8" and result and result.cosine > 0.99


def test_a_control_flow_body_stays_fp32_and_reads_outer_tensors_through_casts(tmp_path):
    """An If whose branches read a tensor of the main graph (made FP16 by the export):
    the If runs as written, in FP32, its branches reading that tensor through one Cast."""
    h = helper
    c = numpy_helper.from_array(np.array([3.0], np.float32), "c")
    then = h.make_graph(
        [h.make_node("Add", ["m", "c"], ["t"], name="then_add")],
        "then",
        [],
        [h.make_tensor_value_info("t", F32, [2, 4])],
    )
    other = h.make_graph(
        [h.make_node("Sub", ["m", "c"], ["e"], name="else_sub")],
        "else",
        [],
        [h.make_tensor_value_info("e", F32, [2, 4])],
    )
    nodes = [
        h.make_node("Mul", ["x", "two"], ["m"], name="double"),
        h.make_node("ReduceSum", ["x"], ["s"], keepdims=0, name="sum"),
        h.make_node("Greater", ["s", "zero"], ["positive"], name="test"),
        h.make_node("If", ["positive"], ["y"], then_branch=then, else_branch=other, name="branch"),
    ]
    consts = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        c,
    ]
    graph = h.make_graph(
        nodes,
        "branchy",
        [h.make_tensor_value_info("x", F32, [2, 4])],
        [h.make_tensor_value_info("y", F32, [2, 4])],
        initializer=consts,
    )
    path = tmp_path / "if.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8), str(path))
    art = export(str(path), None, tmp_path / "if16.onnx")
    assert art.fp32_nodes == ("branch",)
    assert any("If body runs as written, in FP32" in w for w in art.warnings)
    out = onnx.load(str(art.path))
    (branch,) = [n for n in out.graph.node if n.op_type == "If"]
    bodies = {a.name: a.g for a in branch.attribute}
    assert bodies["then_branch"].node[0].input[:] == ["m__fp32", "c"]  # c: FP32, read only there
    types = elem_types(art.path)
    assert types["m"] == F16 and types["m__fp32"] == F32 and types["c"] == F32
    x = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float32)
    for sign in (1, -1):
        (got,) = plain_ort(art.path).run(None, {"x": sign * x})
        np.testing.assert_array_equal(got, 2 * sign * x + 3 * sign)  # exact in FP16 and FP32
    assert fp16lens.verify(str(path), art.path, (x,))


def test_a_file_fp16lens_exported_keeps_its_module_map_and_takes_fp32_modules(tmp_path):
    """An FP32 file written by export(model, ..., "fp32") carries each node's module: the
    ONNX-in export keeps that map and takes islands by module, as export(model) does."""
    pytest.importorskip("onnxscript")
    model, inputs = models.gelu_span()
    fp32 = export(model, inputs, tmp_path / "g32.onnx", precision="fp32")
    art = export(str(fp32.path), None, tmp_path / "g16.onnx", fp32_modules=["fc1", "act", "fc2"])
    assert art.fp32_nodes and {art.node_map[n] for n in art.fp32_nodes} <= {"fc1", "act", "fc2"}
    assert set(fp32.node_map.items()) <= set(art.node_map.items())
    assert fp16lens.verify(model, art.path, inputs, tolerance=0.9999)
    with pytest.raises(ExportError, match="no node of the graph comes from"):
        export(str(fp32.path), None, tmp_path / "x.onnx", fp32_modules=["fc9"])


def test_constants_nothing_reads_are_left_as_they_are(clean_file, tmp_path):
    """A rewrite (patch's exact BatchNormalization form) can leave the old statistics behind,
    read by nothing: beyond FP16 (9.8e7) they are no reason to refuse the export."""
    _, inputs, path = clean_file
    proto = onnx.load(path)
    dead = np.full(4, 9.8e7, np.float32)
    proto.graph.node.insert(0, _const("old_var", dead))
    proto.graph.initializer.append(numpy_helper.from_array(dead, "old_mean"))
    src = tmp_path / "leftovers.onnx"
    onnx.save(proto, str(src))
    art = export(str(src), None, tmp_path / "left16.onnx")
    out = onnx.load(str(art.path))
    (node,) = [n for n in out.graph.node if n.output[0] == "old_var"]
    (init,) = [i for i in out.graph.initializer if i.name == "old_mean"]
    assert (numpy_helper.to_array(node.attribute[0].t) == dead).all()
    assert (numpy_helper.to_array(init) == dead).all()
    assert fp16lens.verify(path, art.path, inputs)


def _free_width_convs(path) -> str:
    """x (1, 3, 16, W) -> Conv -> Relu -> Conv -> Relu -> Conv, W free: a line of text or
    a spectrogram of any length, as another tool writes it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    shapes = {"w1": (16, 3, 3, 3), "w2": (16, 16, 3, 3), "w3": (4, 16, 3, 3)}
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.25, s).astype(np.float32), k)
        for k, s in shapes.items()
    ]
    inits += [
        numpy_helper.from_array(rng.normal(0, 0.1, s[0]).astype(np.float32), f"b{k[1]}")
        for k, s in shapes.items()
    ]
    conv = {"pads": [1] * 4}
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="c1", **conv),
            helper.make_node("Relu", ["a"], ["ra"], name="r1"),
            helper.make_node("Conv", ["ra", "w2", "b2"], ["b"], name="c2", **conv),
            helper.make_node("Relu", ["b"], ["rb"], name="r2"),
            helper.make_node("Conv", ["rb", "w3", "b3"], ["y"], name="c3", **conv),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, "W"])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_int8_calibration_of_several_lengths_on_a_free_axis(tmp_path):
    """Calibration and held-out batches of several widths along an axis the graph leaves
    free (audio clips, text lines) are taken as they are: the search runs each on its own
    (before, a refusal asked to pad them to one shape). Ground truth: ONNX Runtime without
    fp16lens runs the written file as written on a width none of them had, close to FP32;
    a target's fallback runs on them too."""
    import onnxruntime as ort

    src = _free_width_convs(tmp_path / "free.onnx")
    torch.manual_seed(0)
    cal = [(torch.rand(1, 3, 16, w),) for w in (16, 24, 40, 32)]
    held = [(torch.rand(1, 3, 16, w),) for w in (20, 56)]
    art = export(src, None, tmp_path / "q.onnx", precision="int8", calibration=cal, evaluation=held)
    assert art.parity is not None and art.parity.passed, art.parity
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    q = ort.InferenceSession(str(art.path), so, providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).random((1, 3, 16, 72), dtype=np.float32)
    got, want = q.run(None, {"x": x})[0], ref.run(None, {"x": x})[0]
    assert got.shape == want.shape == (1, 4, 16, 72)
    cosine = float((got * want).sum() / np.sqrt((got * got).sum() * (want * want).sum()))
    assert cosine > 0.995, cosine
    assert sum(n.op_type == "QuantizeLinear" for n in onnx.load(str(art.path)).graph.node) >= 3
    kept = export(
        src,
        None,
        tmp_path / "t.onnx",
        precision="int8",
        calibration=cal,
        evaluation=held,
        target=0.99999,
        max_fallback=1.0,
    )
    assert kept.parity is not None and kept.parity.passed


def test_a_pytorch_model_is_told_which_dynamic_axis_takes_its_lengths(capsys, tmp_path):
    """A PyTorch model exported at one sequence length refuses calibration of another in one
    line that names dynamic='sequence'; exported so, it takes both lengths and passes its
    check on a third. An axis dynamic= cannot free (a Conv1d's time, dimension 2) gets no
    such advice."""

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Tagger().eval()
    cal = [(torch.randn(1, n, 8),) for n in (5, 9, 7, 16, 5, 12, 20, 6)]
    with pytest.raises(ExportError, match=r"1x9x8 \(batch 2 of 8\).*dynamic='sequence'"):
        export(model, cal[0], tmp_path / "a.onnx", precision="int8", calibration=cal)
    art = export(
        model,
        cal[0],
        tmp_path / "d.onnx",
        precision="int8",
        calibration=cal,
        evaluation=[(torch.randn(1, 12, 8),)],
        dynamic="sequence",
    )
    assert art.parity is not None and art.parity.passed
    # from a terminal: the flag it names, and the command with it writes the file
    from fp16lens.cli import main

    (tmp_path / "tagger.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))\n"
        "    return m.eval(), (torch.randn(1, 5, 8),)\n"
    )
    torch.save(cal, tmp_path / "cal.pt")
    argv = [
        "export",
        f"{tmp_path / 'tagger.py'}:build",
        "-o",
        str(tmp_path / "t.onnx"),
        "--precision",
        "int8",
        "--calibration",
        str(tmp_path / "cal.pt"),
    ]
    assert main(argv) == 2
    assert "or export the model with --dynamic sequence" in capsys.readouterr().err
    assert main([*argv, "--dynamic", "sequence"]) == 0
    conv = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3, padding=1)).eval()
    frames = [(torch.randn(1, 4, n),) for n in (50, 80)]
    with pytest.raises(ExportError, match=r"1x4x80 .*items\)$"):
        export(conv, frames[0], tmp_path / "c.onnx", precision="int8", calibration=frames)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_source_the_checker_refuses_but_onnx_runtime_runs_is_exported(
    precision, tmp_path, capsys
):
    """A graph output declared with a type and no shape fails onnx.checker's basic check,
    and ONNX Runtime runs the file: the export was a traceback (the checker's
    ValidationError, exit 1). A flaw of the source is not ours to refuse; the written file
    is checked by running it, and runs like the source."""
    from fp16lens.cli import main

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        "no_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w],
    )
    src, out = tmp_path / "m.onnx", tmp_path / f"m_{precision}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(str(src))
    x = rng.normal(size=(4, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    argv = ["export", str(src), "-o", str(out), "--precision", precision]
    assert main([*argv, "--input", str(tmp_path / "x.npy")]) == 0, capsys.readouterr()
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    a = ref.run(None, {"x": x[:1]})[0]
    b = np.asarray(got.run(None, {"x": x[:1]})[0], np.float32)
    assert float(a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999
