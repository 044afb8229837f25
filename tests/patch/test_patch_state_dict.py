"""The most common way to ship a PyTorch model: torch.save(patched.state_dict()), then
load_state_dict into the model's own class. A state_dict holds weights and statistics,
not a norm's eps; what the fix needs beyond them must not be lost without a word.

Batch norms keep their own eps (the affine form, also where their input is rescaled), so
the loaded model computes what the patched one does, bit for bit in FP32, and real FP16
keeps the fix. A layer norm's eps / p^2 cannot live in a state_dict: the plan's note names
it, and the ways it names (``fp16lens.patch.save``, patching again from the saved report)
keep the fix exactly; so do a multiply the fix inserts in a forward and the FP32 islands
(tests/patch/test_patch_islands.py).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import fp16lens
from fp16lens.patch import STATE_DICT_NOTE

import models


def _patched(build):
    model, inputs = build()
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(*inputs)
    patched = fp16lens.patch(model, lens.report, batches=[inputs])
    return model, patched, inputs, lens.report


def _loaded(model, patched):
    """The user's class (a copy of the original model, its own eps) with the patched
    weights, through a file."""
    buffer = io.BytesIO()
    torch.save(patched.state_dict(), buffer)
    buffer.seek(0)
    loaded = copy.deepcopy(model)
    loaded.load_state_dict(torch.load(buffer), strict=True)
    return loaded


def _flat(out) -> torch.Tensor:
    if torch.is_tensor(out):
        return out.float().flatten()
    return torch.cat([_flat(o) for o in (out.values() if isinstance(out, dict) else out)])


def _fp16_cosine(model, inputs, ref: torch.Tensor) -> float:
    with torch.no_grad():
        out = _flat(copy.deepcopy(model).half()(*(x.half() for x in inputs)))
    return float(F.cosine_similarity(out, ref, dim=0)) if torch.isfinite(out).all() else 0.0


@pytest.mark.parametrize(
    "build",
    [models.seed_case, fp16lens.demo.build_demo_model, models.bn_huge_var],
    ids=["seed_case", "demo", "bn_huge_var"],
)
@torch.no_grad()
def test_batch_norm_fixes_survive_a_state_dict(build):
    model, patched, inputs, _ = _patched(build)
    rules = {r.rule for r in patched._fp16lens_plan.reparametrized}
    assert "bn-affine" in rules
    loaded = _loaded(model, patched)
    assert torch.equal(_flat(loaded(*inputs)), _flat(patched(*inputs)))  # bit for bit
    ref = _flat(model(*inputs))
    assert _fp16_cosine(model, inputs, ref) < 0.99  # the problem, in real FP16
    assert _fp16_cosine(loaded, inputs, ref) > 0.9999  # the fix, after the journey
    assert not any(STATE_DICT_NOTE in n for n in patched._fp16lens_plan.notes)


@torch.no_grad()
def test_a_rescaled_batch_norm_input_keeps_eps():
    """The seed case's span enters batch norms with their input divided by p: scaling the
    statistics would give them eps / p^2, the affine form keeps eps."""
    model, patched, _, _ = _patched(models.seed_case)
    scaled = [r for r in patched._fp16lens_plan.reparametrized if r.s_in != 1]
    bns = [r for r in scaled if r.rule.startswith("bn")]
    assert bns and all(r.rule == "bn-affine" for r in bns)
    for r in bns:
        assert patched.get_submodule(r.module).eps == model.get_submodule(r.module).eps


@torch.no_grad()
def test_a_norms_eps_is_named_and_kept_by_the_ways_the_note_names(tmp_path):
    model, patched, inputs, report = _patched(models.layernorm_variance)
    plan = patched._fp16lens_plan
    norms = [r.module for r in plan.reparametrized if r.rule == "norm" and r.s_in != 1]
    assert norms
    (note,) = [n for n in plan.notes if n.startswith(STATE_DICT_NOTE)]
    assert "eps / p^2" in note
    for name in norms[:3]:
        assert f"{name}.eps = {patched.get_submodule(name).eps:.4g}" in note
    assert "fp16lens.patch.save" in note and "Report.load" in note
    ref = patched(*inputs)
    # the state_dict alone keeps the old eps: the loaded model is not the patched one
    assert _loaded(model, patched).get_submodule(norms[0]).eps == model.get_submodule(norms[0]).eps
    # fp16lens.patch.save keeps it
    path = fp16lens.patch.save(patched, inputs, tmp_path / "patched.pt2")
    assert torch.equal(torch.export.load(str(path)).module()(*inputs), ref)
    # so does patching the original weights again from the saved report
    report.save(tmp_path / "report.json")
    again = fp16lens.patch(
        copy.deepcopy(model), fp16lens.Report.load(tmp_path / "report.json"), batches=[inputs]
    )
    assert torch.equal(again(*inputs), ref)


@torch.no_grad()
def test_a_multiply_in_the_forward_is_named_and_kept_by_the_saved_file(tmp_path):
    """A tied weight cannot take the stream's scale: the fix multiplies an operand in the
    model's forward, which the original class does not run."""
    model, patched, inputs, _ = _patched(models.shared_weight)
    plan = patched._fp16lens_plan
    assert plan.multiplies
    (note,) = [n for n in plan.notes if n.startswith(STATE_DICT_NOTE)]
    assert f"{len(plan.multiplies)} multiply(s)" in note
    ref = patched(*inputs)
    loaded = _loaded(model, patched)
    for name, mod in patched.named_modules():  # even with every eps set as the patch's
        if isinstance(getattr(mod, "eps", None), float):
            loaded.get_submodule(name).eps = mod.eps
    assert not torch.allclose(loaded(*inputs), ref, rtol=1e-3)  # what the note warns of
    path = fp16lens.patch.save(patched, inputs, tmp_path / "patched.pt2")
    assert torch.equal(torch.export.load(str(path)).module()(*inputs), ref)


@torch.no_grad()
def test_a_torchscript_file_runs_other_lengths_and_a_program_keeps_the_examples(tmp_path):
    """What the docs say of the two files fp16lens.patch.save writes: a .pt2 program holds
    the example inputs' shapes (torch.export specializes them), a TorchScript .pt runs a
    sequence of another length with the fix."""
    _, patched, inputs, _ = _patched(models.layernorm_variance)
    longer = (torch.randn(2, 9, inputs[0].shape[-1]) * inputs[0].abs().max(),)
    assert longer[0].shape[1] != inputs[0].shape[1]
    script = torch.jit.load(str(fp16lens.patch.save(patched, inputs, tmp_path / "p.pt")))
    torch.testing.assert_close(script(*longer), patched(*longer), rtol=1e-6, atol=1e-6)
    program = torch.export.load(str(fp16lens.patch.save(patched, inputs, tmp_path / "p.pt2")))
    with pytest.raises(Exception, match=r"Guard failed|shape|size"):
        program.module()(*longer)
