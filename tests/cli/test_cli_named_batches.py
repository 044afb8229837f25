"""Batches by input name in a ``.pt`` file (a dict of tensors, or a list of them), from a
terminal: an ONNX graph's inputs by name, a module's forward keywords."""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import pytest
import torch
import zoo_real

from fp16lens.cli import main

SAMPLES = 144160  # speechmos: INPUT_LENGTH 9.01 s at 16 kHz


SCALED = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale):
        return self.lin(x) * scale


def build():
    torch.manual_seed(0)
    return Scaled()
"""


def test_a_modules_keywords_by_name(tmp_path, capsys):
    """Each dict is the forward's keywords: a scale of 1e5 is found as the input that
    overflows (named by its keyword), one of 1 is safe (a float64 one cast, with a note),
    and a name the forward does not take is one line, exit 2."""
    (tmp_path / "scaled_model.py").write_text(SCALED, encoding="utf-8")
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    torch.save([{"scale": torch.full((2, 1), 1e5), "x": x}], tmp_path / "big.pt")
    torch.save({"x": x, "scale": torch.ones(2, 1, dtype=torch.float64)}, tmp_path / "one.pt")
    torch.save({"x": x, "scal": torch.ones(2, 1)}, tmp_path / "bad.pt")
    model = str(tmp_path / "scaled_model.py") + ":build"
    assert main(["scan", model, "--input", str(tmp_path / "big.pt"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] is False, data
    (found,) = [f for f in data["findings"] if f["mechanism"] == "input"]
    assert found["peak"] == 1e5 and "model input 0 (scale) holds" in found["detail"], found
    assert main(["scan", model, "--input", str(tmp_path / "one.pt"), "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["clean"] is True
    assert "float64 inputs cast to the model's float32" in got.err
    assert main(["scan", model, "--input", str(tmp_path / "bad.pt")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "unexpected keyword argument 'scal'" in line, line


@pytest.mark.parametrize("suffix", [".pt", ".pt2"])
def test_a_model_patched_on_keyword_batches_is_saved_and_runs(tmp_path, capsys, suffix):
    """patch on batches of forward keywords saves the patched model as TorchScript (the
    keywords traced in the forward's order) and as a torch.export program: each file gives
    the model's outputs. Before, ``.pt`` was a traceback and ``.pt2`` a refusal."""
    (tmp_path / "scaled_model.py").write_text(SCALED, encoding="utf-8")
    batch = {"scale": torch.full((2, 1), 3.0), "x": torch.randn(2, 4)}
    torch.save([batch], tmp_path / "one.pt")
    model = str(tmp_path / "scaled_model.py") + ":build"
    report, out = str(tmp_path / "report.json"), str(tmp_path / f"patched{suffix}")
    assert main(["scan", model, "--input", str(tmp_path / "one.pt"), "--save", report]) == 0
    code = main(
        ["patch", model, "--report", report, "--input", str(tmp_path / "one.pt"), "-o", out]
    )
    assert code == 0, capsys.readouterr().err
    spec = importlib.util.spec_from_file_location("scaled_model", tmp_path / "scaled_model.py")
    written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written)
    want = written.build()(**batch)
    if suffix == ".pt":
        got = torch.jit.load(out)(batch["x"], batch["scale"])
    else:
        got = torch.export.load(out).module()(**batch)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_keyword_only_forward_is_refused_for_torchscript_in_one_line(tmp_path):
    """TorchScript traces positional arguments: a forward whose input is keyword-only
    cannot be saved so, and ``save`` says to save a torch.export program instead."""
    from fp16lens._core import Fp16LensError
    from fp16lens.patch import save

    class KeywordOnly(torch.nn.Module):
        def forward(self, *, x):
            return x * 2

    with pytest.raises(Fp16LensError, match=r"keyword-only inputs \(x\).*-o m\.pt2"):
        save(KeywordOnly(), {"x": torch.ones(2)}, tmp_path / "m.pt")


def test_personalized_dnsmos_from_a_terminal_with_clips_by_input_name(tmp_path, capsys):
    """speechmos's personalized DNSMOS, clips saved as ``{"input_1": clip}``. Ground truth
    without fp16lens: real FP16 storage scores the first speaker NaN (quiet STFT bins and the
    1e-12 guard flush to 0 before the log). scan says so, patch fixes it on that speaker,
    and the FP16 file, its storage made real, scores the other speaker and that speaker
    40 dB quieter within 0.01 MOS of FP32; verify says the same."""
    ort = pytest.importorskip("onnxruntime")
    path = zoo_real.or_skip(zoo_real.pdnsmos_model)
    one = np.resize(zoo_real.speech().numpy()[0], SAMPLES) / 32768
    two = np.resize(zoo_real.speech(path=zoo_real.SPEECH2_WAV).numpy()[0], SAMPLES) / 32768
    clips = {"cal": [one], "held": [two, two / 100]}
    files = {}
    for name, sounds in clips.items():
        files[name] = str(tmp_path / f"{name}.pt")
        torch.save(
            [{"input_1": torch.tensor(c[None], dtype=torch.float32)} for c in sounds], files[name]
        )
    feeds = {k: [{"input_1": c[None].astype(np.float32)} for c in v] for k, v in clips.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        (half,) = zoo_real.onnx_real_fp16(path, feeds["cal"][0]).values()
    assert np.isnan(half).all()
    report, patched, fp16 = (str(tmp_path / n) for n in ("r.json", "p.onnx", "m16.onnx"))
    assert main(["scan", path, "--input", files["cal"], "--save", report, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    found = {(f["kind"], f["site"]) for f in data["findings"]}
    assert ("flush-singular", "mos_estimator_logpow/Log") in found, data
    assert main(["patch", path, "--report", report, "--input", files["cal"], "-o", patched]) == 0
    assert "real FP16 on 1 batch(es): proven" in capsys.readouterr().out
    assert (
        main(["export", patched, "-o", fp16, "--precision", "fp16", "--input", files["held"]]) == 0
    )
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for feed in feeds["held"]:
        (ref,) = sess.run(None, feed)
        (got,) = zoo_real.onnx_fp16_file_real(fp16, feed).values()
        assert np.isfinite(got).all() and np.abs(got - ref).max() < 0.01, (ref, got)
    capsys.readouterr()
    assert main(["verify", path, fp16, "--input", files["held"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_a_nested_positional_input_is_named_by_its_position_alone():
    """A tuple argument's second tensor is model input 1, not "1 (0)": only a keyword or a
    graph input gives a name."""
    import fp16lens

    class Pair(torch.nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    model = Pair()
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model((torch.ones(2), torch.full((2,), 1e5)))
    (found,) = [f for f in lens.report.findings if f.mechanism == "input"]
    assert found.detail.startswith("model input 1 holds values up to 1e+05"), found.detail
