"""FP32 islands under .half(), verify, torch.export and state_dict loads, for every kind of
island: attention (fused fast paths read its weights), embeddings (integer inputs),
activations, conv and batch norm. Built through patch() where it places the island and
directly (Fp32Island(...)) where it does not. Ground truth: real FP16 runs on CPU
(``copy.deepcopy(m).half()``)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
import zoo_real
from torch import nn

import fp16lens
from fp16lens._core.compat import TORCH_VERSION
from fp16lens.patch import Fp32Island, get_plan, patch, relative_error

from models import attention_span, bn_huge_var, embedding_row, gelu_span


def _report(model, inputs):
    # grad enabled: under no_grad the TransformerEncoderLayer's fused kernel hides the
    # attention's internals from watch
    with fp16lens.watch(model) as lens:
        model(*inputs)
    return lens.report


def _half_args(inputs):
    return tuple(a.half() if a.is_floating_point() else a for a in inputs)


@torch.no_grad()
def _half(model, inputs):
    return copy.deepcopy(model).half()(*_half_args(inputs))


def _cosine(a, b) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _by_patch(build, islands):
    model, inputs = build()
    patched = patch(model, _report(model, inputs))
    assert get_plan(patched).fp32_modules == islands
    return model, patched, inputs


def _direct(build, wrap):
    model, inputs = build()
    patched = copy.deepcopy(model)
    wrap(patched)
    return model, patched, inputs


def _wrap_attention_layer(m):
    m.layer = Fp32Island(m.layer)


def _wrap_attention(m):
    m.layer.self_attn = Fp32Island(m.layer.self_attn)


@torch.no_grad()
def _wrap_embedding(m):  # what patch() does: the island leaves /16, fc absorbs it
    m.emb = Fp32Island(m.emb, 1.0, 16.0)
    m.fc.weight.mul_(16.0)


def _wrap_conv_bn(m):
    m.conv, m.bn = Fp32Island(m.conv), Fp32Island(m.bn)


# kind -> (model, patched model, inputs, island names, whether the patch only adds islands)
CASES = {
    "attention": lambda: (*_by_patch(attention_span, ["layer.self_attn"]), True),
    "attention-direct": lambda: (*_direct(attention_span, _wrap_attention), True),
    "attention-layer": lambda: (*_direct(attention_span, _wrap_attention_layer), True),
    "embedding-direct": lambda: (*_direct(embedding_row, _wrap_embedding), False),
    "gelu": lambda: (*_by_patch(gelu_span, ["act"]), False),
    "conv-bn": lambda: (*_direct(bn_huge_var, _wrap_conv_bn), True),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]()


def _islands(patched):
    return {n: m for n, m in patched.named_modules() if isinstance(m, Fp32Island)}


def test_half_runs_and_fixes_what_real_fp16_breaks(case):
    model, patched, inputs, _ = case
    with torch.no_grad():
        want = model(*inputs)
        assert relative_error(want, patched(*inputs)) <= 1e-5  # FP32: the same model
    broken = _half(model, inputs).float()
    assert not relative_error(want, broken) <= 0.5  # the problem is real (NaN, inf or wrong)
    got = _half(patched, inputs)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert relative_error(want, got.float()) <= 2e-3 and _cosine(want, got.float()) >= 0.9999
    half = copy.deepcopy(patched).half()
    for island in _islands(half).values():
        assert all(p.dtype == torch.float32 for p in island.parameters())


def test_verify_passes_the_patched_model_and_fails_the_original(case):
    model, patched, inputs, _ = case
    batches = [inputs]
    assert not fp16lens.verify(model, model, batches, backend="torch-fp16")
    assert fp16lens.verify(model, patched, batches, backend="torch-fp16")
    assert fp16lens.verify(model, patched, batches, backend="torch-emulated")


# torch 2.4's exporters: torch.export checks each parameter against the state_dict by its
# module path (an island keeps the wrapped module's keys), and the ONNX exporters cannot
# export the fused attention kernel that eval-mode attention runs
NEEDS_TORCH_2_5 = pytest.mark.skipif(
    TORCH_VERSION < (2, 5), reason="exporting a patched model with FP32 islands needs torch >= 2.5"
)


@NEEDS_TORCH_2_5
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_torch_export_program_runs_matches_and_saves(case, half, tmp_path):
    _, patched, inputs, _ = case
    m = copy.deepcopy(patched).half() if half else copy.deepcopy(patched)
    args = _half_args(inputs) if half else inputs
    with torch.no_grad():
        want = m(*args)
        program = torch.export.export(m, args)
        got = program.module()(*args)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 if half else 1e-5)
        torch.export.save(program, tmp_path / "island.pt2")
        loaded = torch.export.load(tmp_path / "island.pt2").module()(*args)
        assert torch.equal(loaded, got)


def _zeroed(model):
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for t in fresh.state_dict().values():
            t.zero_()
    return fresh


def test_state_dict_keeps_the_original_keys_and_loads_both_ways(case):
    model, patched, inputs, islands_only = case
    original, saved = model.state_dict(), patched.state_dict()
    assert list(saved) == list(original)
    for name, island in _islands(patched).items():  # islands keep the weights exact
        for key in island.module.state_dict():
            assert torch.equal(saved[f"{name}.{key}"], original[f"{name}.{key}"])
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    into_original = _zeroed(model)  # the original class, every tensor overwritten
    into_original.load_state_dict(torch.load(buffer), strict=True)
    into_patched = _zeroed(patched)
    into_patched.load_state_dict(original, strict=True)
    with torch.no_grad():
        for name in _islands(patched):
            got = into_patched.get_submodule(name).module.state_dict()
            assert all(torch.equal(v, original[f"{name}.{k}"]) for k, v in got.items())
        assert all(torch.equal(v, saved[k]) for k, v in into_original.state_dict().items())
        if islands_only:  # nothing rescaled: either checkpoint is the other's
            assert torch.equal(into_original(*inputs), model(*inputs))
            assert torch.equal(into_patched(*inputs), patched(*inputs))


def test_a_state_dict_drops_the_islands_and_fp16lens_save_keeps_them(tmp_path):
    """What the plan's note and docs/export.md say, checked without fp16lens: the attention
    span's ``state_dict`` loads into the original class (same keys) and real FP16 is NaN
    there again; a plain ``torch.export`` does not run under ``.half()``; the ``.pt2`` that
    ``fp16lens.patch.save`` writes, loaded by torch alone, and the whole module pickled,
    keep the fix under ``.half()``."""
    model, inputs = attention_span()
    patched = patch(model, _report(model, inputs))
    note = [n for n in get_plan(patched).notes if "state_dict" in n]
    assert len(note) == 1 and "fp16lens.patch.save" in note[0]
    with torch.no_grad():
        want = model(*inputs)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(patched.state_dict(), strict=True)
    assert not bool(torch.isfinite(_half(fresh, inputs)).all())
    try:  # a plain torch.export: not a file that keeps them
        torch.export.save(torch.export.export(patched, inputs), tmp_path / "plain.pt2")
    except Exception:  # torch 2.4 cannot export the island's module at all
        assert TORCH_VERSION < (2, 5)
    else:
        plain = torch.export.load(tmp_path / "plain.pt2").module()
        with pytest.raises(RuntimeError, match="dtype"), torch.no_grad():
            plain.half()(*_half_args(inputs))
    path = fp16lens.patch.save(patched, inputs, tmp_path / "patched.pt2")
    loaded = torch.export.load(str(path)).module()
    torch.save(patched, tmp_path / "whole.pt")  # the whole module: fp16lens needed to load
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    for kept in (loaded, whole):
        with torch.no_grad():
            got = kept.half()(*_half_args(inputs))
        assert bool(torch.isfinite(got).all()) and _cosine(got, want) >= 0.999


def test_output_dtype_follows_the_dtype_the_model_is_cast_to():
    model, (ids,) = embedding_row()
    model.emb = Fp32Island(model.emb, 1.0, 16.0)
    assert model(ids).dtype == torch.float32  # integer input: no float dtype to return to
    assert model.half()(ids).dtype == torch.float16
    assert model.to("cpu")(ids).dtype == torch.float16  # a device move keeps it
    assert model.float()(ids).dtype == torch.float32
    assert model.to(torch.bfloat16)(ids).dtype == torch.bfloat16
    assert model.emb.module.weight.dtype == torch.float32
    half = Fp32Island(nn.Embedding(4, 2).half())  # wrapped from a half model: half outside
    assert half(torch.tensor([1])).dtype == torch.float16


@torch.no_grad()
def test_attention_tuple_output_scales_only_the_attention_output():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    island = Fp32Island(copy.deepcopy(mha), in_scale=4.0, out_scale=2.0).half()
    q = torch.randn(2, 3, 8)
    mask = torch.triu(torch.full((3, 3), -1.0e4), 1)  # keyword float: cast, not scaled
    out, weights = island(q.half(), q.half(), q.half(), attn_mask=mask.half())
    want_out, want_weights = mha(q * 4.0, q * 4.0, q * 4.0, attn_mask=mask)
    assert out.dtype == weights.dtype == torch.float16
    torch.testing.assert_close(out.float(), want_out / 2.0, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(weights.float(), want_weights, rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_enclosing_layer_takes_its_module_by_module_path():
    """The fused TransformerEncoderLayer kernel would read the island's FP32 weights with
    FP16 activations; around an island the layer runs as with the fast path disabled."""
    model, inputs = attention_span()
    layer = copy.deepcopy(model.layer).half()
    layer.self_attn = Fp32Island(layer.self_attn)
    x = model.inp(*inputs).half()
    got = layer(x)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        want = layer(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert torch.equal(got, want) and torch.isfinite(got).all()


def test_top_level_island_state_dict_is_the_wrapped_modules():
    bn = nn.BatchNorm2d(3).eval()
    island = Fp32Island(copy.deepcopy(bn))
    saved = island.state_dict()
    assert list(saved) == list(bn.state_dict())
    assert saved._metadata[""]["version"] == bn.state_dict()._metadata[""]["version"]
    bn.load_state_dict(saved, strict=True)
    with torch.no_grad():
        bn.running_var.fill_(9.0)
    island.load_state_dict({f"module.{k}": v for k, v in bn.state_dict().items()})  # old keys
    assert torch.equal(island.module.running_var, bn.running_var)
    holder = nn.Module()  # a wrapped module with a member named "module" of its own
    holder.module = nn.Linear(2, 2)
    twice = Fp32Island(_zeroed(holder))
    assert list(twice.state_dict()) == ["module.weight", "module.bias"]
    twice.load_state_dict(holder.state_dict(), strict=True)
    assert torch.equal(twice.module.module.weight, holder.module.weight)


def test_pickled_patched_model_keeps_its_islands(tmp_path):
    model, patched, inputs = _direct(embedding_row, _wrap_embedding)  # patch() rescales the table
    torch.save(patched.half(), tmp_path / "patched.pt")
    loaded = torch.load(tmp_path / "patched.pt", weights_only=False)
    assert loaded.emb.outside_dtype == torch.float16 and list(loaded.state_dict()) == list(
        model.state_dict()
    )
    with torch.no_grad():
        assert torch.equal(loaded(*inputs), patched(*inputs))


@NEEDS_TORCH_2_5
@pytest.mark.parametrize("build", [gelu_span, attention_span], ids=["gelu", "attention"])
def test_fp16_onnx_export_keeps_patched_islands_fp32(build, tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    from fp16lens.export import export

    model, inputs = build()
    patched = patch(model, _report(model, inputs))
    islands = get_plan(patched).fp32_modules
    art = export(patched, inputs, tmp_path / "patched.onnx", precision="fp16")
    modules = {art.node_map[n] for n in art.fp32_nodes}
    assert modules and all(any(m == i or m.startswith(f"{i}.") for i in islands) for m in modules)
    session = ort.InferenceSession(str(art.path), providers=["CPUExecutionProvider"])
    feed = {i.name: a.numpy() for i, a in zip(session.get_inputs(), inputs)}
    (got,) = zoo_real.onnx_fp16_file_real(str(art.path), feed).values()  # FP16 storage real
    with torch.no_grad():
        want = model(*inputs)
    assert _cosine(want, torch.from_numpy(got).float()) >= 0.999
