"""The seed case (resnet18 + FPN neck) exported to strongly typed FP16 ONNX."""

from __future__ import annotations

import numpy as np
import pytest
import torch

COMPUTE = {"Conv", "Gemm", "MatMul"}


def test_every_conv_gemm_matmul_is_fp16(seed_fp16, ox):
    model = ox.onnx.load(str(seed_fp16.path))
    types = ox.elem_types(model)
    compute = [n for n in model.graph.node if n.op_type in COMPUTE]
    assert len(compute) == 26  # resnet18's 20 convs + the neck's 5 + the head
    for node in compute:
        assert {types[t] for t in node.input if t} == {ox.FLOAT16}, node.name
        assert types[node.output[0]] == ox.FLOAT16, node.name


def test_float_tensors_are_fp16_except_graph_io(seed_fp16, ox):
    model = ox.onnx.load(str(seed_fp16.path))
    types = ox.elem_types(model)
    io = {v.name for v in [*model.graph.input, *model.graph.output]}
    fp32 = {name for name, t in types.items() if t == ox.FLOAT}
    assert fp32 - io == _resize_scales(model)  # Resize scales are float32 by the ONNX spec
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(casts) == 2  # input to FP16, output back to FP32: no island here
    assert seed_fp16.fp32_nodes == ()


def _resize_scales(model) -> set[str]:
    return {
        n.input[2] for n in model.graph.node if n.op_type == "Resize" and n.input[2:3] != [""]
    } - {""}


def test_passes_the_full_checker_and_runs_in_onnxruntime(seed, seed_fp16, ox):
    model = ox.onnx.load(str(seed_fp16.path))
    ox.onnx.checker.check_model(model, full_check=True)
    assert 10 <= model.ir_version <= 13  # ONNX Runtime 1.31 reads IR <= 13
    assert seed_fp16.opset >= 17 and seed_fp16.exporter == "dynamo"
    net, (x,) = seed
    out = ox.run(seed_fp16.path, {model.graph.input[0].name: x.numpy()})
    (y,) = out.values()
    assert y.dtype == np.float32 and y.shape == tuple(net(x).shape)


def test_node_map_covers_the_graph(seed_fp16):
    assert seed_fp16.coverage >= 0.95
    assert set(seed_fp16.node_map) == {n.name for n in seed_fp16.nodes}


def test_layer4_nodes_map_back_to_layer4(seed_fp16, ox):
    model = ox.onnx.load(str(seed_fp16.path))
    by_weight = {n.input[1]: n.name for n in model.graph.node if n.op_type == "Conv"}
    conv2 = by_weight["backbone.layer4.1.conv2.weight"]
    # batch norm folded into the conv: the node computes bn2's output, from both modules
    assert seed_fp16.node_map[conv2] == "backbone.layer4.1.bn2"
    assert set(seed_fp16.node_modules[conv2]) == {
        "backbone.layer4.1.conv2",
        "backbone.layer4.1.bn2",
    }
    layer4_1 = {m for m in seed_fp16.node_map.values() if m.startswith("backbone.layer4.1")}
    assert layer4_1 == {
        "backbone.layer4.1",  # the residual add
        "backbone.layer4.1.bn1",
        "backbone.layer4.1.bn2",
        "backbone.layer4.1.relu",
    }


def _module_outputs(model, inputs, names):
    """Ground truth from PyTorch: the last output of each named module."""
    seen = {}
    handles = [
        model.get_submodule(n).register_forward_hook(
            lambda mod, a, out, n=n: seen.__setitem__(n, out.detach().clone())
        )
        for n in names
    ]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_tensor_for_site_holds_the_site_values(seed, seed_fp32, ox):
    net, (x,) = seed
    sites = ["backbone.layer4.1.bn2", "backbone.layer4.1", "neck.reduce_c5.1", "neck.smooth.2"]
    names = {s: seed_fp32.tensor_for_site(s) for s in sites}
    names["add"] = seed_fp32.tensor_for_site("backbone.layer4.1:add")
    assert None not in names.values()
    out = ox.run(seed_fp32.path, {"x": x.numpy()}, extra=list(names.values()))
    truth = _module_outputs(net, (x,), sites)
    for site in sites:
        got, want = torch.from_numpy(out[names[site]]), truth[site]
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    # the block's output is relu(add): the add's tensor is the pre-activation
    block = torch.relu(torch.from_numpy(out[names["add"]]))
    want = truth["backbone.layer4.1"]
    torch.testing.assert_close(block, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    assert float(want.abs().max()) > 65504  # the values FP16 cannot hold: the seed's span


def test_folded_conv_has_no_tensor_of_its_own(seed_fp32):
    assert seed_fp32.tensor_for_site("backbone.layer4.1.conv2") is None
    assert seed_fp32.tensor_for_site("not.a.module") is None
    assert seed_fp32.tensor_for_site("backbone.layer4.1:add#2") is None


def test_subnormal_weights_are_reported_as_real_fp16_rounds_them(seed_fp16, seed_fp32, ox):
    # neck.reduce_c5 folds a batch norm with a huge running_var: its weights are tiny
    def weight(art):
        model = ox.onnx.load(str(art.path))
        init = next(i for i in model.graph.initializer if i.name == "neck.reduce_c5.0.weight")
        return ox.onnx.numpy_helper.to_array(init)

    fp32, half = weight(seed_fp32), weight(seed_fp16)
    assert fp32.dtype == np.float32 and half.dtype == np.float16
    np.testing.assert_array_equal(half, fp32.astype(np.float16))
    zeroed = int(((fp32 != 0) & (half == 0)).sum())
    below_normal = int(((half != 0) & (np.abs(half) < np.float16(2**-14))).sum()) + zeroed
    assert zeroed > 0 and below_normal > half.size // 2
    warning = next(w for w in seed_fp16.warnings if "subnormal" in w)
    assert "neck.reduce_c5.0.weight of 'neck.reduce_c5.0', 'neck.reduce_c5.1' (" in warning
    assert (
        f"({below_normal} of {half.size} values subnormal, {zeroed} of them 0 in FP16)" in warning
    )


@pytest.mark.parametrize("exporter", ["torchscript"])
def test_torchscript_exporter_maps_scoped_names(seed, tmp_path, exporter):
    pytest.importorskip("onnx")
    from fp16lens.export import export

    net, inputs = seed
    art = export(net, inputs, tmp_path / "ts.onnx", "fp32", exporter=exporter)
    assert art.exporter == "torchscript"
    assert art.coverage >= 0.95
    assert art.node_map["/backbone/layer4/layer4.1/conv2/Conv"] == "backbone.layer4.1.conv2"
    assert art.node_map["/backbone/layer4/layer4.1/Add"] == "backbone.layer4.1"
    assert art.node_map["/backbone/layer4/layer4.1/relu_1/Relu"] == "backbone.layer4.1.relu"
    assert art.node_map["/Sigmoid"] == ""


def test_seed_span_as_an_fp32_island(seed_fp32, ox):
    """The seed span's fallback fix: layer4.1 and the neck's reducing conv in FP32."""
    from fp16lens.export import retype

    islands = ["backbone.layer4.1", "neck.reduce_c5"]
    art = retype(seed_fp32.path, seed_fp32.path.with_name("island.onnx"), fp32_modules=islands)
    model = ox.onnx.load(str(art.path))
    types = ox.elem_types(model)

    def inside(node_name):
        module = art.node_map[node_name]
        return any(module == i or module.startswith(f"{i}.") for i in islands)

    computes = [n for n in model.graph.node if n.op_type != "Cast"]
    for node in computes:
        want = ox.FLOAT if inside(node.name) else ox.FLOAT16
        assert types[node.output[0]] == want, (node.name, art.node_map[node.name])
    assert {n.name for n in computes if inside(n.name)} == set(art.fp32_nodes)
    consumers = {}
    for n in model.graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    producer = {o: n for n in model.graph.node for o in n.output}
    boundary = [
        c
        for c in model.graph.node
        if c.op_type == "Cast" and c.input[0] in producer and c.output[0] in consumers
    ]
    assert len(boundary) == 2  # one Cast in (layer4.0's output), one out (to the upsamplings)
    for cast in boundary:  # each one crosses the island's boundary
        source = inside(producer[cast.input[0]].name)
        assert {inside(c.name) for c in consumers[cast.output[0]]} == {not source}, cast.name
    assert sum(n.op_type == "Cast" for n in model.graph.node) == 4  # + graph input/output
