"""MODEL arguments: demo, module:callable, file.py:callable, TorchScript .pt, export .pt2."""

from __future__ import annotations

import pytest
import torch

from fp16lens._core import Fp16LensError
from fp16lens.cli._models import load_model, parse_kwargs

import models


def test_callable_returning_model_and_inputs_gives_default_inputs():
    loaded = load_model("models:clean")
    model, inputs = models.clean()
    assert type(loaded.model) is type(model) and not loaded.model.training
    assert torch.equal(loaded.example_inputs[0], inputs[0])
    torch.testing.assert_close(loaded.model(*inputs), model(*inputs))


def test_kwargs_reach_the_callable():
    loaded = load_model("models:bn_huge_var", parse_kwargs('{"after_relu": true}'))
    assert isinstance(loaded.model.act, torch.nn.ReLU)
    with pytest.raises(Fp16LensError, match="not valid JSON"):
        parse_kwargs("{after_relu: true}")
    with pytest.raises(Fp16LensError, match="must be a JSON object"):
        parse_kwargs("[1]")


def test_python_file_callable(tmp_path):
    (tmp_path / "mynet.py").write_text(
        "import torch\ndef build(width=4):\n    return torch.nn.Linear(3, width)\n"
    )
    loaded = load_model(f"{tmp_path / 'mynet.py'}:build", {"width": 5})
    assert loaded.model.out_features == 5 and loaded.example_inputs is None


def test_torchscript_and_exported_program_files(tmp_path):
    model, (x,) = models.clean()
    torch.jit.trace(model, (x,)).save(str(tmp_path / "m.pt"))
    torch.export.save(torch.export.export(model, (x,)), str(tmp_path / "m.pt2"))
    with torch.no_grad():
        expected = model(x)
        for name in ("m.pt", "m.pt2"):
            got = load_model(str(tmp_path / name)).model(x)
            torch.testing.assert_close(got, expected)
    # the exported program keeps the module hierarchy (site names stay qualified)
    names = {n for n, _ in load_model(str(tmp_path / "m.pt2")).model.named_modules()}
    assert "features.0" in names


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
        ("models:no_such_builder", "has no callable 'no_such_builder'"),
        ("models:WATCH_CASES", "has no callable 'WATCH_CASES'"),
        ("missing.pt", "model file missing.pt does not exist"),
        ("resnet18", "is not understood"),
    ],
)
def test_bad_model_specs(spec, message):
    with pytest.raises(Fp16LensError, match=message):
        load_model(spec)


def test_a_file_that_is_not_torchscript(tmp_path):
    torch.save({"w": torch.ones(1)}, tmp_path / "weights.pt")
    with pytest.raises(Fp16LensError, match="is not a TorchScript file"):
        load_model(str(tmp_path / "weights.pt"))
    (tmp_path / "junk.pt2").write_bytes(b"junk")
    with pytest.raises(Fp16LensError, match=r"is not a torch\.export program"):
        load_model(str(tmp_path / "junk.pt2"))
