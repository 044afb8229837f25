"""patch() on transformers' residual streams, judged by real FP16 on the CPU
(``copy.deepcopy(m).half()``): a residual producer's weights are raised so the stream
passes 65504 (``models.plant_linear``). The whole stream carries one 2^-k from the
embeddings (tables, a class token, position embeddings: parameters scaled in place) to
its norms (exits, eps / p^2); everything added into it comes from a linear projection
(an attention output, an MLP down projection, GPT-2's Conv1D) that absorbs 1/p. No FP32
island, no run-time multiply; FP32 unchanged, FP16 finite and close to FP32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp16lens
from fp16lens._core.algebra import Kind, fused_kind, input_linear_weight, output_linear_child
from fp16lens.patch import get_plan, relative_error

from models import (
    ScaledProducts,
    embedding_row,
    hf_tiny,
    plant_linear,
    tied_stream,
    timm_convnext_atto,
    timm_vit_tiny,
    tv_swin_tiny,
    tv_vit_tiny,
)
from plant import assert_fixed, cosine, run_half, watch_report


def _exact(model, inputs):
    """The planted stream is fixed (``plant.assert_fixed``) with parameters alone."""
    the_plan, report = assert_fixed(model, inputs)
    assert not the_plan.islands and not the_plan.unresolved and not the_plan.multiplies
    return the_plan, report


def _one_stream(the_plan):
    [region] = the_plan.regions
    return region, {r.module: r for r in the_plan.reparametrized}


def test_torchvision_vit_stream_from_class_token_to_final_norm():
    model, inputs = tv_vit_tiny()
    the_plan, _ = _exact(model, inputs)
    region, by = _one_stream(the_plan)
    p = region.factor
    assert set(region.entries) >= {
        "conv_proj",
        "encoder.layers.encoder_layer_0.mlp.3",
        "encoder.layers.encoder_layer_1.self_attention.out_proj",
    }
    assert "encoder.ln" in region.exits and "encoder.layers.encoder_layer_0.ln_1" in region.exits
    # the parameters joining the stream take its scale in place (no run-time op)
    assert (by["class_token"].rule, by["class_token"].s_out) == ("parameter", p)
    assert (by["encoder.pos_embedding"].rule, by["encoder.pos_embedding"].s_out) == ("parameter", p)
    assert by["encoder.layers.encoder_layer_0.ln_1"].s_in == p  # a norm: eps / p^2
    # attention's input projections see LN outputs: unscaled
    assert not any("self_attention" in m and "out_proj" not in m for m in by)


def test_torchvision_swin_functional_projection_and_patch_merging_carry_the_stream():
    """Swin's attention returns F.linear(x, proj.weight, proj.bias): proj's parameters absorb
    1/p though proj never runs as a module; the patch merging's cat of four slices of the
    stream carries its scale to the merging's norm."""
    model, inputs = tv_swin_tiny()
    the_plan, _ = _exact(model, inputs)
    region, by = _one_stream(the_plan)
    assert "features.1.1.attn:addmm#2" in region.entries and "features.2:cat" in region.sites
    assert "features.2.norm" in region.exits
    assert (
        by["features.1.1.attn.proj.weight"].s_out
        == by["features.1.1.attn.proj.bias"].s_out
        == region.factor
    )
    assert "features.1.1.attn.qkv.weight" not in by  # the attention itself is unscaled


@pytest.mark.slow
def test_timm_vit_twelve_blocks_one_stream():
    model, inputs = timm_vit_tiny()
    the_plan, _ = _exact(model, inputs)
    region, by = _one_stream(the_plan)
    assert len(region.entries) == 1 + 2 * 12 and "norm" in region.exits
    assert by["cls_token"].s_out == by["pos_embed"].s_out == region.factor


def test_gpt2_conv1d_projections_and_embeddings_absorb_the_stream_scale():
    model, inputs = hf_tiny("gpt2", plant="model.h.0.mlp.c_proj")
    the_plan, _ = _exact(model, inputs)
    region, by = _one_stream(the_plan)
    assert {"model.wte", "model.wpe", "model.h.0.attn.c_proj", "model.h.1.mlp.c_proj"} <= set(
        region.entries
    )
    assert by["model.wte"].s_out == region.factor and by["model.h.0.attn.c_proj"].rule == "linear"
    assert not any(m.endswith("c_attn") or m.endswith("c_fc") for m in by)  # fed by LN outputs


def test_bert_post_ln_add_is_absorbed_by_its_layer_norm():
    model, inputs = hf_tiny("bert", plant="model.encoder.layer.0.output.dense")
    the_plan, _ = _exact(model, inputs)
    region, _ = _one_stream(the_plan)
    assert "model.encoder.layer.0.output.LayerNorm" in region.exits


def test_llama_stream_through_rms_norms():
    model, inputs = hf_tiny("llama", plant="model.layers.0.mlp.down_proj")
    the_plan, _ = _exact(model, inputs)
    region, _ = _one_stream(the_plan)
    assert "model.embed_tokens" in region.entries and "model.norm" in region.exits


def test_t5_stream_is_exact_where_its_fp16_clamp_is_not():
    """T5 clamps its stream to the FP16 range in a .half() run: finite but wrong. The
    rescaled stream needs no clamp."""
    model, inputs = hf_tiny("t5", plant="model.encoder.block.0.layer.1.DenseReluDense.wo")
    with torch.no_grad():
        want = model(*inputs)
    before = run_half(model, inputs)
    assert cosine(want, torch.nan_to_num(before)) < 0.99
    report = watch_report(model, inputs)
    patched = fp16lens.patch(model, report)
    the_plan = get_plan(patched)
    assert not the_plan.islands and not the_plan.unresolved and not the_plan.multiplies
    with torch.no_grad():
        assert relative_error(want, patched(*inputs)) <= 1e-6
    after = run_half(patched, inputs)
    assert torch.isfinite(after).all() and cosine(want, after) >= 0.999


def test_hf_vit_stream_from_its_cls_token_and_position_embeddings():
    model, inputs = hf_tiny("vit", plant="model.layers.0.mlp.fc2")
    the_plan, _ = _exact(model, inputs)
    region, by = _one_stream(the_plan)
    assert by["model.embeddings.cls_token"].rule == "parameter"
    assert by["model.embeddings.position_embeddings"].s_out == region.factor


@pytest.mark.parametrize("kind", ["gpt2", "vit"])
def test_a_clean_transformer_gets_an_empty_plan(kind):
    model, inputs = hf_tiny(kind)
    assert torch.isfinite(run_half(model, inputs)).all()
    the_plan = fp16lens.plan(model, watch_report(model, inputs))
    assert not the_plan.changes and not the_plan.regions and not the_plan.unresolved


def test_a_clean_torchvision_vit_gets_an_empty_plan():
    model, inputs = tv_vit_tiny(plant=None)
    the_plan = fp16lens.plan(model, watch_report(model, inputs))
    assert not the_plan.changes and not the_plan.regions


def test_an_embedding_row_beyond_fp16_is_rescaled_not_islanded():
    """The table takes 1/p (its input is integer), the Linear after it takes p back."""
    model, inputs = embedding_row()
    the_plan, _ = assert_fixed(model, inputs)
    assert not the_plan.islands and not the_plan.multiplies
    by = {r.module: r for r in the_plan.reparametrized}
    assert by["emb"].s_out == by["fc"].s_in > 1


def test_a_tied_embedding_keeps_its_table_and_the_stream_gets_a_multiply():
    """The table is also the head's weight: scaling it would scale the logits. The stream's
    other operand is multiplied instead (exact, one scalar op)."""
    model, inputs = tied_stream()
    the_plan, _ = assert_fixed(model, inputs)
    assert not the_plan.islands and not the_plan.unresolved
    assert "embed" not in {r.module for r in the_plan.reparametrized}
    assert [m.cut for m in the_plan.multiplies] == [("embed",)]


class _XW(nn.Module):
    """x @ W + b with W stored (in, out), as HF's Conv1D; ``power`` 2 squares the result."""

    def __init__(self, power: int = 1):
        super().__init__()
        self.power, self.weight, self.bias = (
            power,
            nn.Parameter(torch.randn(8, 6)),
            nn.Parameter(torch.randn(6)),
        )

    def forward(self, x):
        return (x @ self.weight + self.bias) ** self.power


def test_probes_find_weights_by_what_modules_compute():
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    assert input_linear_weight(mha, x) == ("in_proj_weight", None)  # q, k, v read x through it
    assert output_linear_child(mha, x) == ("out_proj.weight", "out_proj.bias")
    assert output_linear_child(nn.Sequential(nn.Linear(8, 8), nn.GELU()), x) is None
    assert (
        input_linear_weight(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)), x) is None
    )  # the norm: invariant
    assert fused_kind(_XW()) == Kind.LINEAR and fused_kind(_XW(power=2)) is None


@pytest.mark.slow
def test_convnext_layer_scale_passes_the_stream_scale():
    """ConvNeXt multiplies each block's output by a layer-scale parameter before the add:
    a product of the stream with a constant passes its scale (found with torch.fx), so the
    stage is one region from its downsample to the next depthwise convs, no island."""
    model, inputs = timm_convnext_atto()
    the_plan, _ = _exact(model, inputs)
    [region] = the_plan.regions
    assert {"stages.1.blocks.1:mul", "stages.1.blocks.1:add"} <= set(region.sites)
    assert "stages.1.blocks.1.mlp.fc2" in region.entries


def test_a_product_with_a_number_passes_the_scale_a_square_does_not():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = plant_linear(ScaledProducts(square=False).eval(), (x,), "fc1", target=8 * 65504.0)
    the_plan, _ = _exact(model, (x,))
    [region] = the_plan.regions
    assert ":mul" in region.sites and "fc2" in region.exits
    square = ScaledProducts(square=True).eval()
    square.load_state_dict(model.state_dict())
    graph_plan = fp16lens.plan(square, watch_report(square, (x,)))
    assert not any(
        ":mul#2" in r.sites for r in graph_plan.regions
    )  # x * x: degree 2, never in a region
