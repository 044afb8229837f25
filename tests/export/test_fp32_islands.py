"""FP32 islands in a strongly typed FP16 export: exactly the island's nodes FP32."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from models import gelu_span

pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """gelu_span with a patch plan keeping the GELU in FP32, FP16 graph inputs/outputs."""
    from fp16lens.export import export

    model, inputs = gelu_span()
    model._fp16lens_plan = types.SimpleNamespace(fp32_modules=["act"])
    path = tmp_path_factory.mktemp("gelu") / "gelu_io16.onnx"
    return export(model, inputs, path, io_dtype="fp16"), model, inputs


def _compute_dtypes(ox, model):
    """Node name -> element type of its first output, for every node except Casts."""
    t = ox.elem_types(model)
    return {n.name: t[n.output[0]] for n in model.graph.node if n.op_type != "Cast"}


def test_only_the_island_computes_in_fp32(planned, ox):
    art, _, _ = planned
    model = ox.onnx.load(str(art.path))
    dtypes = _compute_dtypes(ox, model)
    island = {n for n, m in art.node_map.items() if m == "act" and n in dtypes}
    assert island and {n for n, d in dtypes.items() if d == ox.FLOAT} == island
    assert {n for n, d in dtypes.items() if d == ox.FLOAT16} == set(dtypes) - island
    assert set(art.fp32_nodes) == island
    assert [n.op_type for n in model.graph.node if n.name in island] == ["Gelu"]


def test_casts_only_at_the_island_boundary(planned, ox):
    art, _, _ = planned
    model = ox.onnx.load(str(art.path))
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(casts) == 2  # io_dtype="fp16": no Casts at the graph's inputs/outputs
    into, out_of = sorted(casts, key=lambda c: [n.name for n in model.graph.node].index(c.name))
    to = {c.name: ox.onnx.helper.get_attribute_value(c.attribute[0]) for c in casts}
    assert to[into.name] == ox.FLOAT and to[out_of.name] == ox.FLOAT16
    assert art.node_map[producer[into.input[0]].name] == "fc1"
    assert [art.node_map[c.name] for c in consumers[into.output[0]]] == ["act"]
    assert art.node_map[producer[out_of.input[0]].name] == "act"
    assert [art.node_map[c.name] for c in consumers[out_of.output[0]]] == ["fc2"]
    io = [*model.graph.input, *model.graph.output]
    assert {v.type.tensor_type.elem_type for v in io} == {ox.FLOAT16}


def test_checker_and_onnxruntime_accept_it(planned, ox):
    art, model, (x,) = planned
    onnx_model = ox.onnx.load(str(art.path))
    ox.onnx.checker.check_model(onnx_model, full_check=True)
    (y,) = ox.run(art.path, {"x": x.half().numpy()}).values()
    assert y.dtype == np.float16 and y.shape == tuple(model(x).shape)


def test_explicit_fp32_modules_with_fp32_io(tmp_path, ox):
    from fp16lens.export import export

    model, (x,) = gelu_span()
    art = export(model, (x,), tmp_path / "gelu.onnx", fp32_modules=["act"])
    onnx_model = ox.onnx.load(str(art.path))
    dtypes = _compute_dtypes(ox, onnx_model)
    assert {n for n, d in dtypes.items() if d == ox.FLOAT} == set(art.fp32_nodes)
    assert [art.node_map[n] for n in art.fp32_nodes] == ["act"]
    io = [*onnx_model.graph.input, *onnx_model.graph.output]
    assert {v.type.tensor_type.elem_type for v in io} == {ox.FLOAT}
    casts = [n for n in onnx_model.graph.node if n.op_type == "Cast"]
    assert len(casts) == 4  # the island's two, plus input -> FP16 and FP16 -> output
    (y,) = ox.run(art.path, {"x": x.numpy()}).values()
    assert y.dtype == np.float32


def test_weight_beyond_fp16_is_refused_unless_in_an_island(tmp_path, ox):
    from fp16lens.export import ExportError, export, retype

    model, inputs = gelu_span()
    with torch.no_grad():
        model.fc1.weight.mul_(50.0)  # beyond 65504: inf in real FP16
    assert torch.isinf(model.fc1.weight.half()).any()
    fp32 = export(model, inputs, tmp_path / "gelu_fp32.onnx", "fp32")  # FP32: no check
    with pytest.raises(ExportError, match=r"'fc1\.weight' of 'fc1'.*fp32_modules=\['fc1'\]"):
        retype(fp32.path, tmp_path / "refused.onnx", "fp16")
    art = retype(fp32.path, tmp_path / "island.onnx", "fp16", fp32_modules=["fc1", "act"])
    weights = ox.onnx.load(str(art.path)).graph.initializer
    assert {w.name: w.data_type for w in weights}["fc1.weight"] == ox.FLOAT
    assert {art.node_map[n] for n in art.fp32_nodes} == {"fc1", "act"}
    with pytest.raises(ExportError, match="'fc9'"):
        retype(fp32.path, tmp_path / "bad.onnx", "fp16", fp32_modules=["fc9"])


def test_unknown_island_names_the_closest_module():
    from fp16lens.export import ExportError, export

    model, inputs = gelu_span()
    with pytest.raises(ExportError, match=r"'acts'.*Did you mean 'act'"):
        export(model, inputs, "unused.onnx", fp32_modules=["acts"])
