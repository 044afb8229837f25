"""A score beside a shared offset: the plain cosine of values 2.5 to 4 hides errors of a
tenth. verify reports each output's cosine about FP32's mean, and holds it to the
tolerance where ``Tolerance(about_mean=True)`` (INT8's default); the INT8 search's cosine
target does the same."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fp16lens.verify import Tolerance, verify
from fp16lens.verify._metrics import Accumulator
from fp16lens.verify._result import output_failures


class Score(nn.Module):
    """A quality score on a 1-to-5 scale: one value per item, around 3."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            self.head.weight.copy_(0.1 * torch.randn(1, 16, generator=g))
            self.head.bias.fill_(3.0)

    def forward(self, x):
        return self.head(x)


def _about_mean(ref: np.ndarray, cand: np.ndarray) -> float:
    """Independent of fp16lens: the cosine of both about the reference's mean."""
    a, b = ref.ravel() - ref.mean(), cand.ravel() - ref.mean()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_a_score_off_by_a_tenth_of_its_spread_fails_where_the_plain_cosine_passes():
    model = Score().eval()
    off = copy.deepcopy(model)
    with torch.no_grad():
        off.head.bias.add_(0.08)  # every score 0.08 higher: a constant error
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(1, 16, generator=g) for _ in range(8)]  # one item per batch
    with torch.no_grad():
        ref = np.array([float(model(x)) for x in batches])
        got = np.array([float(copy.deepcopy(off).half()(x.half())) for x in batches])
    assert ref.std() > 0.25 and abs(got - ref - 0.08).max() < 0.01  # the ground truth
    held = Tolerance(about_mean=True)  # FP16's default judges the plain cosine alone
    assert verify(model, off, batches, backend="torch-fp16").passed
    result = verify(model, off, batches, backend="torch-fp16", tolerance=held)
    assert result.cosine > 0.9995  # the plain cosine cannot see it
    assert result.cosine_about_mean == pytest.approx(_about_mean(ref, got), abs=1e-6)
    assert result.cosine_about_mean < 0.99
    assert not result.passed
    (line,) = result.failures()
    assert "cosine about FP32's mean" in line and "shared offset" in line, line
    # the model itself in real FP16 keeps the score: it passes, about the mean too
    same = verify(model, model, batches, backend="torch-fp16", tolerance=held)
    assert same.passed and same.cosine_about_mean > 0.9999, same.outputs
    # the table shows the column only where it says what the plain cosine hides
    assert "about mean" in _shown(result) and "about mean" not in _shown(same)


def _shown(result) -> str:
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=160).print(result)
    return out.getvalue()


def test_an_output_that_varies_below_what_fp16_holds_is_judged_by_its_plain_cosine():
    g = torch.Generator().manual_seed(0)
    near_constant, one_value = Accumulator(), Accumulator()
    for _ in range(4):
        ref = 1000 + 1e-3 * torch.randn(2, 3, generator=g)
        near_constant.update(ref, ref.half().float())  # FP16 holds 1000 to 0.5
    one_value.update(torch.tensor([[3.2]]), torch.tensor([[3.5]]))
    for acc in (near_constant, one_value):
        m = acc.result()
        assert m.cosine_about_mean is None and m.cosine == pytest.approx(1.0)
        assert not output_failures("out", m, Tolerance(min_cosine=0.999))


def test_the_int8_search_judges_a_cosine_target_about_the_mean_too():
    from fp16lens.export._int8_search import cosine, worst_cosine

    rng = np.random.default_rng(0)
    refs = [[np.float32([[3 + 0.5 * rng.standard_normal()]])] for _ in range(8)]
    outs = [[r[0] + np.float32(0.1 * rng.standard_normal())] for r in refs]
    assert min(cosine(r[0], o[0]) for r, o in zip(refs, outs)) == 1.0  # one value: its sign
    ref = np.concatenate([r[0].ravel() for r in refs])
    got = np.concatenate([o[0].ravel() for o in outs])
    assert worst_cosine(refs, outs) == pytest.approx(_about_mean(ref, got), abs=1e-6)
    assert worst_cosine(refs, outs) < 0.99


def test_dnsmos_in_fp16_off_by_a_tenth_of_a_point_is_seen_about_the_mean(tmp_path, capsys):
    """DNSMOS P.835 exported to FP16 as it is (speechmos's wheel; SIG, BAK and OVRL near 1
    to 4): on a noisy clip of the second speaker its FP16 storage made real (without
    fp16lens) moves a score by 0.12, and the plain cosine of the three scores is still
    0.9999. verify reports 0.97 about FP32's mean, and fails it when asked to hold that
    (``Tolerance(about_mean=True)``); a clip FP16 holds to a thousandth passes that too."""
    import warnings

    import int8_zoo
    import onnxruntime as ort
    import zoo_real

    from fp16lens.export import export

    case = zoo_real.or_skip(int8_zoo.dnsmos, 2, 8)
    warnings.simplefilter("ignore")
    out = tmp_path / "fp16.onnx"
    export(case.path, None, out)
    ref = ort.InferenceSession(case.path, providers=["CPUExecutionProvider"])
    for k, bad in ((6, True), (1, False)):
        want = ref.run(None, case.eval[k])[0].ravel()
        (got,) = zoo_real.onnx_fp16_file_real(str(out), case.eval[k]).values()
        got = got.ravel()
        plain = float(want @ got / np.linalg.norm(want) / np.linalg.norm(got))
        assert plain > 0.9998 and (abs(got - want).max() > 0.1) == bad, (k, got - want)
        result = verify(case.path, out, [case.eval[k]], tolerance=Tolerance(about_mean=True))
        assert result.passed != bad, (k, result.outputs)
        assert result.cosine_about_mean == pytest.approx(_about_mean(want, got), abs=2e-3)
        if bad:
            assert "cosine about FP32's mean" in result.failures()[0]
            assert result.cosine_about_mean < 0.99
    # from a terminal: FP16's default passes the clip, --about-mean holds it to the mean
    from fp16lens.cli import main

    np.savez(tmp_path / "clip.npz", **case.eval[6])
    words = ["verify", case.path, str(out), "--input", str(tmp_path / "clip.npz")]
    assert main(words) == 0
    capsys.readouterr()
    assert main([*words, "--about-mean"]) == 1
    said = capsys.readouterr().out
    assert "cosine about FP32's mean" in said and "about mean" in said, said


def test_silero_vad_in_fp16_passes_by_its_plain_cosine_as_patch_proves_it():
    """Silero VAD's speech probabilities (0 to 1, mean 0.86 on the sentence) move by up to
    0.1 in real FP16 and keep each decision at 0.5: FP16's default tolerance judges the
    plain cosine, as patch's proof and scan's FP16 check do, and passes it; held to the
    mean (0.997) it would fail."""
    import zoo_real

    model, inputs = zoo_real.or_skip(zoo_real.CASES["silero_vad/speech"].build)
    with torch.no_grad():
        want = model(*inputs)
        got = copy.deepcopy(model).half()(*(x.half() for x in inputs)).float()
    assert ((want > 0.5) == (got > 0.5)).all() and (got - want).abs().max() > 0.05
    plain = verify(model, model, inputs, backend="torch-fp16")
    assert plain.passed and plain.cosine_about_mean < 0.999, plain.outputs
    held = verify(model, model, inputs, backend="torch-fp16", tolerance=Tolerance(about_mean=True))
    assert not held.passed


def test_a_tolerance_given_keeps_the_backends_about_mean_unless_it_says():
    from fp16lens._core import OptionError
    from fp16lens.verify import backend_spec
    from fp16lens.verify._options import resolve_tolerance

    int8, fp16 = backend_spec("onnx-int8").tolerance, backend_spec("onnx-fp16").tolerance
    assert resolve_tolerance(Tolerance(min_cosine=0.995), int8).about_mean is True
    assert resolve_tolerance(0.995, int8).about_mean is True
    assert resolve_tolerance(Tolerance(about_mean=False), int8).about_mean is False
    assert resolve_tolerance(None, fp16).about_mean is False
    assert resolve_tolerance(Tolerance(about_mean=True), fp16).about_mean is True
    with pytest.raises(OptionError, match="about_mean"):
        Tolerance(about_mean="yes")


def test_about_mean_said_twice_must_agree():
    """``about_mean`` can be said by the tolerance and by verify's own argument; where both
    say it and disagree, verify refuses in one line rather than let one silently win (the
    argument did, before). Where they agree, or one is left None, it is taken."""
    from fp16lens._core import OptionError
    from fp16lens.verify import VerifyOptions

    with pytest.raises(OptionError, match=r"about_mean=True and the tolerance's about_mean=False"):
        VerifyOptions(tolerance=Tolerance(about_mean=False), about_mean=True)
    model = torch.nn.Linear(4, 2)
    inputs = torch.randn(3, 4)
    with pytest.raises(OptionError, match="disagree: set it in one place"):
        verify(model, model, inputs, tolerance=Tolerance(about_mean=True), about_mean=False)
    both = verify(model, model, inputs, tolerance=Tolerance(about_mean=True), about_mean=True)
    assert both.tolerance.about_mean is True
    one = verify(model, model, inputs, tolerance=Tolerance(min_cosine=0.99), about_mean=True)
    assert one.tolerance.about_mean is True and one.tolerance.min_cosine == 0.99
