"""A patched model saved by fp16lens keeps its FP32 islands (issue #27): the saved file runs
in FP32 as the patched model does and, after a plain ``.half()`` outside fp16lens, in real
FP16 with its islands working; ``fp16lens export`` of the file keeps the islands FP32
without being told, and ``fp16lens verify`` passes the file and its ONNX export.

Ground truth: the original model's real FP16 (``copy.deepcopy(m).half()``) breaks, the
saved file loaded with torch alone and cast with ``.half()`` does not."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import fp16lens
from fp16lens._core.compat import TORCH_VERSION
from fp16lens.cli import main
from fp16lens.patch import Fp32Island, patch, relative_error
from fp16lens.patch._portable import PortableIsland, portable


def _island_cases():
    """The island kinds of tests/patch/test_patch_islands.py (attention, embedding, GELU,
    conv and batch norm; placed by patch() or directly)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "patch" / "test_patch_islands.py"
    spec = importlib.util.spec_from_file_location("_island_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


CASES = _island_cases()


def _half_args(inputs):
    return tuple(a.half() if a.is_floating_point() else a for a in inputs)


pytestmark = pytest.mark.skipif(
    TORCH_VERSION < (2, 5), reason="exporting a patched model with FP32 islands needs torch >= 2.5"
)


def _load(path, suffix):
    if suffix == ".pt2":
        return torch.export.load(str(path)).module()
    return torch.jit.load(str(path))


@pytest.mark.parametrize("storage", ["bits", "const"])
@pytest.mark.parametrize("name", list(CASES))
def test_portable_islands_survive_a_file_and_half(name, storage, tmp_path):
    model, patched, inputs, _ = CASES[name]()
    assert any(isinstance(m, Fp32Island) for m in patched.modules())
    saved = portable(patched, storage)
    assert sum(isinstance(m, PortableIsland) for m in saved.modules()) >= 1
    path = tmp_path / ("m.pt2" if storage == "bits" else "m.pt")
    with torch.no_grad():
        want = model(*inputs)
        assert relative_error(want, saved(*inputs)) <= 1e-6  # FP32: the same model
        if storage == "bits":
            torch.export.save(torch.export.export(saved, inputs), str(path))
        else:
            torch.jit.trace(saved, inputs, strict=False, check_trace=False).save(str(path))
        loaded = _load(path, path.suffix)
        assert relative_error(want, loaded(*inputs)) <= 1e-6
        broken = copy.deepcopy(model).half()(*_half_args(inputs)).float()
        assert not relative_error(want, broken) <= 0.5  # real FP16 of the original breaks
        got = loaded.half()(*_half_args(inputs))  # torch alone, as a user would
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert relative_error(want, got.float()) <= 3e-3


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("suffix", [".pt2", ".pt"])
@pytest.mark.parametrize("name", ["gelu_span", "attention_span"])
def test_terminal_journey_scan_patch_export_verify(name, suffix, capsys, tmp_path):
    """The README's journey from a terminal, on a model whose fix is an FP32 island."""
    import models

    model, inputs = getattr(models, name)()
    spec = f"models:{name}"
    report, saved, onnx_file = tmp_path / "r.json", tmp_path / f"p{suffix}", tmp_path / "m.onnx"
    batch = tmp_path / "x.pt"
    torch.save(inputs, batch)
    assert _cli(capsys, "scan", spec, "--save", str(report))[0] == 0
    code, out = _cli(capsys, "patch", spec, "--report", str(report), "-o", str(saved))
    assert code == 0, out
    with torch.no_grad():  # torch alone: the saved file under .half() keeps its islands
        want = model(*inputs)
        got = _load(saved, suffix).half()(*_half_args(inputs))
    assert torch.isfinite(got).all() and relative_error(want, got.float()) <= 3e-3
    code, out = _cli(capsys, "verify", spec, str(saved), "--backend", "torch-fp16")
    assert code == 0, out
    code, out = _cli(
        capsys,
        "export",
        str(saved),
        "-o",
        str(onnx_file),
        "--precision",
        "fp16",
        "--input",
        str(batch),
        "--json",
    )
    assert code == 0, out
    summary = json.loads(out[out.index("{") : out.rindex("}") + 1])  # notes on stderr follow
    assert summary["fp32_nodes"], summary  # the islands, taken from the file's metadata
    code, out = _cli(capsys, "verify", spec, str(onnx_file), "--backend", "onnx-fp16")
    assert code == 0, out
    # the same file exported with its islands dropped fails: the metadata is what keeps them
    if suffix == ".pt2":
        bare = tmp_path / "bare.pt2"
        program = torch.export.load(str(saved))
        torch.export.save(program, str(bare))  # no fp16lens metadata
        code, out = _cli(
            capsys, "export", str(bare), "-o", str(tmp_path / "bare.onnx"), "--precision", "fp16"
        )
        if code == 0:
            code, out = _cli(
                capsys, "verify", spec, str(tmp_path / "bare.onnx"), "--backend", "onnx-fp16"
            )
            assert code != 0, out


def test_torch_emulated_refuses_a_torchscript_candidate_in_one_line(capsys, tmp_path):
    import models

    model, inputs = models.gelu_span()
    with fp16lens.watch(model) as lens:
        model(*inputs)
    saved = tmp_path / "p.pt"
    from fp16lens.patch import save as save_model

    save_model(patch(model, lens.report), inputs, saved)
    code, out = _cli(
        capsys, "verify", "models:gelu_span", str(saved), "--backend", "torch-emulated"
    )
    assert code == 2 and "torch-fp16" in out and "Traceback" not in out


HF_MODEL = """
import torch


def build():
    import transformers as tr

    torch.manual_seed(0)
    m = tr.BertModel(tr.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64,
                                   max_position_embeddings=32)).eval()
    with torch.no_grad():
        m.embeddings.word_embeddings.weight.mul_(2e5)  # a table of values near 1e4
    return m, (torch.randint(0, 100, (2, 12)),)
"""


def test_transformers_model_output_program_exports_and_verifies(capsys, tmp_path):
    """A .pt2 whose outputs are a transformers ModelOutput loads for export (its pytree
    classes are imported from the names the file holds) and the FP16 ONNX verifies; the
    TorchScript file of the same model says how to export instead of a traceback."""
    import models

    models.need_torchvision()  # transformers imports torchvision (the tests' compat step)
    pytest.importorskip("transformers")
    (tmp_path / "hf.py").write_text(HF_MODEL)
    spec = f"{tmp_path}/hf.py:build"
    report, saved, onnx_file = tmp_path / "r.json", tmp_path / "p.pt2", tmp_path / "m.onnx"
    assert _cli(capsys, "scan", spec, "--save", str(report))[0] == 0
    assert _cli(capsys, "patch", spec, "--report", str(report), "-o", str(saved))[0] in (0, 1)
    code, out = _cli(capsys, "export", str(saved), "-o", str(onnx_file), "--precision", "fp16")
    assert code == 0, out
    code, out = _cli(capsys, "verify", spec, str(onnx_file))
    assert code == 0, out
    script = tmp_path / "p.pt"
    assert _cli(capsys, "patch", spec, "--report", str(report), "-o", str(script))[0] in (0, 1)
    ids = tmp_path / "ids.pt"
    torch.save((torch.randint(0, 100, (2, 12)),), ids)
    code, out = _cli(
        capsys, "export", str(script), "-o", str(tmp_path / "s.onnx"), "--input", str(ids)
    )
    assert code == 2 and "torch.export program" in out and "Traceback" not in out
    # dynamic axes: exported and checked on other sizes, or refused when an exporter fixed them
    dyn = tmp_path / "dyn.onnx"
    code, out = _cli(capsys, "export", spec, "-o", str(dyn), "--dynamic", "batch,sequence")
    assert code == 0, out
    import onnxruntime as ort

    session = ort.InferenceSession(str(dyn), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids"]
    assert [o.name for o in session.get_outputs()] == ["last_hidden_state", "pooler_output"]
    hidden, pooled = session.run(None, {"input_ids": torch.randint(0, 100, (3, 7)).numpy()})
    assert hidden.shape == (3, 7, 32) and pooled.shape == (3, 32)
    code, out = _cli(capsys, "export", str(saved), "-o", str(dyn), "--dynamic", "batch,sequence")
    if code != 0:  # a saved program's shapes are static: refused in one line, never a bad file
        assert code == 2 and "does not take other batch and sequence sizes" in out, out
    else:
        session = ort.InferenceSession(str(dyn), providers=["CPUExecutionProvider"])
        ((first, *_),) = [session.get_inputs()]
        assert session.run(None, {first.name: torch.randint(0, 100, (3, 7)).numpy()})[0].shape[
            :2
        ] == (3, 7)


FAMILIES = '''
import torch
from torch import nn


class Cnn(nn.Module):
    """A batch norm of weight 3e5 (its output passes 65504) and a SiLU: an island."""

    def __init__(self):
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        return self.head(self.block2(self.block1(x)))


def cnn():
    torch.manual_seed(0)
    m = Cnn().eval()
    with torch.no_grad():
        m.block2[1].weight.fill_(3e5)
    return m, (torch.rand(1, 3, 16, 16),)
'''


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["fam:cnn", "models:attention_span"], ids=["cnn", "encoder"])
def test_the_journey_as_a_user_runs_it(spec, tmp_path):
    """scan -> patch -o p.pt2 -> export p.pt2 -> verify, each a `python -m fp16lens`
    process; the saved program under .half() in a fresh interpreter with torch alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "fam.py").write_text(FAMILIES)
    tests = str(Path(__file__).parents[1])
    # the caller's PYTHONPATH kept: where fp16lens runs from the checkout (the torch
    # matrix) the processes import it from there
    paths = [str(tmp_path), tests, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}

    def fp16lens_cli(*argv):
        done = subprocess.run(
            [sys.executable, "-m", "fp16lens", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done.returncode, done.stdout + done.stderr

    assert fp16lens_cli("scan", spec, "--save", "r.json", "--fail-on", "any")[0] == 1
    code, out = fp16lens_cli("patch", spec, "--report", "r.json", "-o", "p.pt2")
    assert code == 0, out
    truth = f"""
import copy, sys, torch
module, name = {spec!r}.split(":")
model, inputs = getattr(__import__(module), name)()
half = tuple(a.half() for a in inputs)
with torch.no_grad():
    want = model(*inputs)
    before = copy.deepcopy(model).half()(*half)
    after = torch.export.load("p.pt2").module().half()(*half)
cos = torch.nn.functional.cosine_similarity(after.double().flatten(), want.double().flatten(), dim=0)
print(bool(torch.isfinite(before).all()), bool(torch.isfinite(after).all()), float(cos))
"""
    done = subprocess.run(
        [sys.executable, "-c", truth],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    before, after, cos = done.stdout.split()
    assert before == "False" and after == "True" and float(cos) >= 0.999, done.stdout + done.stderr
    code, out = fp16lens_cli("export", "p.pt2", "-o", "m.onnx", "--precision", "fp16")
    assert code == 0, out
    assert fp16lens_cli("verify", spec, "p.pt2", "--backend", "torch-fp16")[0] == 0
    code, out = fp16lens_cli("verify", spec, "m.onnx")
    assert code == 0, out


@pytest.mark.parametrize("suffix", [".pt2", ".pt"])
@pytest.mark.parametrize(
    "name", ["hardswish_stem", "exp_log", "embedding_output", "silu_pair", "stft_log"]
)
def test_every_island_the_planner_makes_survives_the_file(name, suffix, tmp_path):
    """Islands of the model's own ops (fx), islands handing FP32 to each other, an output
    island that keeps FP32, activation islands, an STFT -> log chain: patched with batches,
    saved as fp16lens saves, loaded with torch alone, cast with .half()."""
    from fp16lens.patch import get_plan
    from fp16lens.patch import save as save_model

    import models

    model, inputs = getattr(models, name)()
    with fp16lens.watch(model) as lens:
        model(*inputs)
    patched = patch(model, lens.report, batches=[inputs])
    x = get_plan(patched).scale_inputs(*inputs)
    path = tmp_path / f"p{suffix}"
    save_model(patched, x, path)
    with torch.no_grad():
        want = model(*inputs)
        broken = copy.deepcopy(model).half()(*_half_args(inputs)).float()
        loaded = _load(path, suffix)
        assert relative_error(want, loaded(*x)) <= 1e-5
        got = loaded.half()(*_half_args(x))
    assert not relative_error(want, broken) <= 0.5  # the original breaks in real FP16
    assert torch.isfinite(got).all() and relative_error(want, got.float()) <= 3e-3
