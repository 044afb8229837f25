"""patch() where a span meets an activation no scale passes (SiLU, GELU, hardswish,
sigmoid, tanh), judged by real FP16 on CPU (``copy.deepcopy(m).half()``): the FP32
island is the activation alone, fed and read in FP16 through its scales, and the
exits around it keep every stored parameter inside FP16."""

from __future__ import annotations

import copy

import pytest
import torch
from rich.console import Console
from torch import fx, nn

from fp16lens._core import PatchError
from fp16lens.patch import Fp32Island, get_plan, patch, plan, relative_error
from fp16lens.patch._actisland import Activation

from models import FunctionModule, act_span, huge_weight_head
from plant import assert_fixed, cosine, plant_overflow, run_half, watch_report


def _island_types(model: nn.Module, the_plan) -> set[type]:
    return {type(model.get_submodule(i.module)) for i in the_plan.islands}


def _stored_beyond_fp16(model: nn.Module) -> list[str]:
    """Parameters and buffers of ``model.half()`` that FP16 cannot hold (inf/NaN)."""
    half = copy.deepcopy(model).half()
    tensors = [*half.named_parameters(), *half.named_buffers()]
    return [n for n, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]


@pytest.mark.slow
@torch.no_grad()
def test_efficientnet_exit_batch_norm_keeps_its_weight_inside_fp16():
    """torchvision efficientnet_b0 (random weights) with a planted overflow: the region's
    factor is 2^40 (the planted batch norm's affine scale is 7e15), its exit conv in the
    next block cannot take it alone, so its output carries 2^26 and the exit batch norm
    after it would store gamma/sigma x 2^26 (6.7e7, inf in FP16). The batch norm's output
    class now takes a factor too, absorbed by the SiLU after it (a scaled FP32 island)."""
    from torchvision_compat import need_torchvision

    tv = need_torchvision()
    torch.manual_seed(0)
    model = tv.models.efficientnet_b0(weights=None).eval()
    inputs = (torch.rand(1, 3, 64, 64),)
    planted = plant_overflow(model, inputs)
    assert not torch.isfinite(run_half(planted, inputs)).all()
    assert _stored_beyond_fp16(planted)  # the planted batch norm's weight
    patched = patch(planted, watch_report(planted, inputs))
    the_plan = get_plan(patched)
    assert not the_plan.unresolved
    assert _stored_beyond_fp16(patched) == []
    assert torch.isfinite(run_half(patched, inputs)).all()
    # nine batch norms in their affine form (float64, rounded once): a few ulps of FP32
    assert relative_error(planted(*inputs), patched(*inputs)) <= 1e-5
    assert _island_types(planted, the_plan) <= {nn.SiLU}


@torch.no_grad()
def test_an_exit_that_cannot_hold_the_factor_becomes_a_scaled_island():
    """fc2 would store W x 128 (beyond FP16) and its output is the model's (no factor can
    follow): it runs in FP32, fed x 128, its parameters untouched."""
    model, inputs = huge_weight_head()
    assert not torch.isfinite(run_half(model, inputs)).all()
    patched = patch(model, watch_report(model, inputs))
    the_plan = get_plan(patched)
    [island] = the_plan.islands
    assert (island.module, island.in_scale, island.out_scale) == ("fc2", 128.0, 1.0)
    assert torch.equal(patched.fc2.weight, model.fc2.weight)
    assert _stored_beyond_fp16(patched) == []
    want = model(*inputs)
    assert relative_error(want, patched(*inputs)) <= 1e-6
    half = run_half(patched, inputs)
    assert torch.isfinite(half).all() and cosine(want, half) >= 0.999


@pytest.mark.parametrize("mlp", [False, True], ids=["conv-bn-act-conv", "linear-act-linear"])
@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
@pytest.mark.parametrize("act", ["silu", "gelu", "hardswish"])
def test_the_island_is_the_activation_alone(act, functional, mlp):
    """Real FP16 is inf/NaN before; after, FP32 within 1e-6 and FP16 cosine >= 0.999, with
    the activation the only FP32 island (fed x p, read / q: the regions before and after it
    carry the scales) and every conv/linear FLOP left in FP16."""
    model, inputs = act_span(act, functional, mlp)
    the_plan, _ = assert_fixed(model, inputs)
    [island] = the_plan.islands
    assert island.module == (f"{act}_fp32" if functional else "act")
    assert island.site == (f":{act}" if functional else "")
    assert island.in_scale > 1 and island.out_scale > 1
    entries = {r.entries for r in the_plan.regions}
    assert entries == {
        ("first",) if mlp else ("first.1",),
        ("act" if not functional else f":{act}",),
    }
    assert not the_plan.unresolved and not the_plan.multiplies
    assert the_plan.fp16_flop_share == 1.0 and the_plan.total_flops > 0


@torch.no_grad()
def test_a_functional_activation_in_a_submodule_becomes_its_child():
    model, inputs = act_span("silu", functional=True, wrap=True)
    report = watch_report(model, inputs)
    patched = patch(model, report)
    assert get_plan(patched).fp32_modules == ["0.silu_fp32"]
    child = patched.get_submodule("0")
    assert isinstance(child, fx.GraphModule) and isinstance(child.silu_fp32, Fp32Island)
    assert isinstance(child.silu_fp32.module, Activation)
    assert patched.state_dict().keys() == model.state_dict().keys()
    assert relative_error(model(*inputs), patched(*inputs)) <= 1e-6
    assert torch.isfinite(run_half(patched, inputs)).all()
    patch(model, report, inplace=True)  # a submodule's forward: the model stays what it is
    assert type(model) is nn.Sequential and isinstance(model[0], fx.GraphModule)


def test_a_module_that_runs_only_the_activation_is_the_island_itself():
    model, inputs = act_span("gelu", mlp=True)
    model.act = FunctionModule(torch.nn.functional.gelu).eval()  # the same function, in a forward
    the_plan, _ = assert_fixed(model, inputs)
    [island] = the_plan.islands
    assert (island.module, island.site) == ("act", "")
    patched = patch(model, watch_report(model, inputs))
    assert isinstance(patched.act, Fp32Island) and isinstance(patched.act.module, FunctionModule)
    assert type(patched) is type(model)  # nothing traced


def test_a_functional_activation_in_the_models_own_forward_needs_a_copy():
    model, inputs = act_span("gelu", functional=True)
    report = watch_report(model, inputs)
    assert isinstance(patch(model, report), fx.GraphModule)
    with pytest.raises(PatchError, match="inplace=False"):
        patch(model, report, inplace=True)


def test_the_plan_counts_islands_and_the_fp16_flop_share():
    model, inputs = huge_weight_head()  # fc2 (a third of the FLOPs) runs in FP32
    the_plan = plan(model, watch_report(model, inputs))
    # fc1: 4 x 8 outputs x 8 multiply-adds, fc2: 4 x 4 outputs x 8; 2 FLOPs each
    assert (the_plan.fp16_flops, the_plan.total_flops) == (2 * 32 * 8, 2 * 32 * 8 + 2 * 16 * 8)
    console = Console(width=120, record=True, color_system=None)
    console.print(the_plan)
    assert (
        "1 FP32 island(s); FP16 FLOP share (conv/linear FLOPs left in FP16 / all): 66.67%"
        in console.export_text()
    )
    assert the_plan.to_dict()["fp16_flop_share"] == pytest.approx(2 / 3)


def test_a_functional_island_exports_with_only_its_nodes_in_fp32(tmp_path):
    """The strongly typed FP16 ONNX export keeps exactly the island's nodes FP32, and the
    faithful onnx-fp16 backend (a Cast to FP16 after every FP16 tensor) passes parity."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from fp16lens.export import export
    from fp16lens.verify import verify

    model, inputs = act_span("silu", functional=True, wrap=True)
    patched = patch(model, watch_report(model, inputs))
    art = export(patched, inputs, tmp_path / "silu.onnx", precision="fp16")
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(art.path)), strict_mode=True).graph
    types_ = {
        v.name: v.type.tensor_type.elem_type
        for v in [*graph.input, *graph.output, *graph.value_info]
    }
    fp32 = {
        n.name
        for n in graph.node
        if n.op_type != "Cast" and types_.get(n.output[0]) == onnx.TensorProto.FLOAT
    }
    ops = {n.name: n.op_type for n in graph.node}
    assert fp32 and fp32 == {
        n for n in art.fp32_nodes if ops[n] != "Cast"
    }  # torch 2.4 lists the Casts
    assert all(art.node_map[n].startswith("0.silu_fp32") for n in fp32)
    result = verify(model, art.path, inputs, backend="onnx-fp16")
    assert result and result.cosine >= 0.999


@pytest.mark.parametrize("kind", ["symbolic_trace", "export"])
def test_a_functional_activation_of_a_graph_module_is_found_by_its_node(kind):
    """A GraphModule (fx.symbolic_trace, or torch.export's aten graph) is edited in place:
    watch named its activation after the node, and the node becomes the island's call.
    (The linear/act/linear span: torch.export's functional batch norm absorbs nothing.)"""
    from fp16lens._core.compat import TORCH_VERSION

    if TORCH_VERSION < (2, 5):
        pytest.skip("patching fx/torch.export graphs is tested from torch 2.5 on")
    model, inputs = act_span("silu", functional=True, mlp=True)
    graph = (
        fx.symbolic_trace(model)
        if kind == "symbolic_trace"
        else torch.export.export(model, inputs).module()
    )
    the_plan, _ = assert_fixed(graph, inputs)
    [island] = the_plan.islands
    assert island.site.startswith(":silu") and island.module.startswith("silu")
    assert the_plan.fp16_flop_share == 1.0
