"""The backend registry: every Backend is registered, names come from the registry only,
"auto" picks as documented, and a runner registered from outside is found by verify()
and the CLI (the extension point)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from fp16lens._core import VerifyError
from fp16lens._core.sites import Backend
from fp16lens.cli import main
from fp16lens.verify import (
    BackendSpec,
    Runner,
    Tolerance,
    backend_spec,
    backends,
    register_backend,
    unregister_backend,
    verify,
)
from fp16lens.verify._registry import pick_backend

from models import clean

NEGATED = "test-negated"


class Negated(Runner):
    """A deliberately wrong backend: the candidate's FP32 output, negated."""

    name = NEGATED
    notes = ("negated on purpose",)

    def __init__(self, candidate: nn.Module):
        self.model = copy.deepcopy(candidate).eval()

    def run(self, batch: tuple) -> list[torch.Tensor]:
        with torch.no_grad():
            return [-self.model(*batch)]


@pytest.fixture
def negated():
    spec = register_backend(BackendSpec(NEGATED, "module", lambda c, m, **_: Negated(c)))
    try:
        yield spec
    finally:
        unregister_backend(NEGATED)
    assert NEGATED not in backends()


def test_every_backend_is_registered_with_its_candidate_kind():
    assert set(Backend) <= set(backends())
    kinds = {name: backend_spec(name).candidate for name in Backend}
    assert kinds == {
        Backend.TORCH_FP16: "module",
        Backend.TORCH_EMULATED: "module",
        Backend.TORCH_TENSORRT: "module",
        Backend.ONNX_FP16: "path",
        Backend.ONNX_INT8: "path",
        Backend.TENSORRT: "path",
    }
    assert [n for n in Backend if backend_spec(n).int8] == [Backend.ONNX_INT8]
    assert backend_spec("onnx-int8").tolerance == Tolerance(
        min_cosine=0.99, site_rel=0.2, about_mean=True
    )
    assert backend_spec("torch-fp16").tolerance == Tolerance()


def test_an_unknown_backend_names_the_known_ones(negated):
    model, inputs = clean()
    with pytest.raises(VerifyError) as info:
        verify(model, model, inputs, backend="fp16")
    assert isinstance(info.value, ValueError)  # what it raised before the registry
    assert all(str(name) in str(info.value) for name in backends())
    assert NEGATED in str(info.value) and "'fp16'" in str(info.value)


def test_a_candidate_of_the_wrong_kind_lists_registered_backends(negated):
    model, inputs = clean()
    with pytest.raises(VerifyError, match="needs an ONNX file path") as info:
        verify(model, model, inputs, backend=Backend.ONNX_FP16)
    assert f"'{NEGATED}'" in str(info.value) and "'torch-emulated'" in str(info.value)
    with pytest.raises(VerifyError, match=r"needs an nn\.Module"):
        verify(model, "m.onnx", inputs, backend=NEGATED)


def test_auto_picks_torch_fp16_for_a_module():
    model, inputs = clean()
    result = verify(model, model, inputs, backend="auto")
    assert result.backend == Backend.TORCH_FP16 and result.backend == "torch-fp16"
    assert verify(model, model, inputs).backend == "torch-fp16"
    assert "backend='torch-fp16'" in repr(result)  # the string, not the enum's repr
    assert json.loads(json.dumps(result.to_dict()))["backend"] == "torch-fp16"


def _graph(path, qdq: bool):
    """x -> Relu -> y, or x -> QuantizeLinear -> DequantizeLinear -> y (scale 1/64)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    inits, nodes = [], [helper.make_node("Relu", ["x"], ["y"])]
    if qdq:
        inits = [
            helper.make_tensor("s", TensorProto.FLOAT, [], [1 / 64]),
            helper.make_tensor("z", TensorProto.INT8, [], [0]),
        ]
        nodes = [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    proto.ir_version = 8
    onnx.save(proto, str(path))
    return path


def test_auto_picks_onnx_fp16_or_int8_by_the_file(tmp_path):
    pytest.importorskip("onnxruntime")
    plain, qdq = _graph(tmp_path / "relu.onnx", False), _graph(tmp_path / "qdq.onnx", True)
    assert pick_backend(str(plain), None).name == Backend.ONNX_FP16
    assert pick_backend(qdq, "auto").name == Backend.ONNX_INT8
    x = (torch.linspace(-1.5, 1.5, 16).reshape(2, 8),)
    relu = verify(nn.ReLU(), plain, x)
    assert relu.backend == "onnx-fp16" and relu and relu.cosine > 0.9999
    assert "holds no FP16 tensor" in relu.notes[0]  # the runner's notes reach the result
    int8 = verify(nn.Identity(), str(qdq), x, tolerance=0.5)
    assert int8.backend == "onnx-int8" and int8.tolerance == Tolerance(
        0.5, site_rel=0.2, about_mean=True
    )
    assert int8.outputs["output"].max_abs <= 1 / 128 + 1e-7  # rounded to the 1/64 grid


def test_a_registered_runner_is_found_by_verify_and_the_cli(negated, capsys):
    model, inputs = clean()
    result = verify(model, model, inputs, backend=NEGATED)
    assert result.backend == NEGATED and not result and result.cosine < -0.99
    assert result.notes == ("negated on purpose",) and result.first_divergence is None
    assert result.tolerance == Tolerance(about_mean=False)  # the spec's default tolerance
    code = main(["verify", "models:clean", "models:clean", "--backend", NEGATED, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["backend"] == NEGATED and not data["passed"]


def test_the_cli_lists_only_registered_backends(negated, capsys):
    assert main(["verify", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert ",".join(["auto", *map(str, backends())]) in help_text.replace(" ", "")
    unregister_backend(NEGATED)
    assert main(["verify", "models:clean", "models:clean", "--backend", NEGATED]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_registration_is_checked():
    with pytest.raises(ValueError, match="already registered"):
        register_backend(backend_spec(Backend.TORCH_FP16))
    with pytest.raises(ValueError, match="candidate must be"):
        BackendSpec("x", "file", Negated)
    with pytest.raises(ValueError, match="other than 'auto'"):
        BackendSpec("auto", "module", Negated)
    model = clean()[0]
    spec = BackendSpec("test-not-a-runner", "module", lambda c, m, **_: object())
    with pytest.raises(TypeError, match=r"not a fp16lens\.verify\.Runner"):
        spec.runner(model, model)
