"""Exporter choice and fallback, opset and norm decomposition, options, reloading a file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp16lens.export import ExportArtifact, ExportError, ExportOptions, export

from models import gelu_span, layernorm_variance, rmsnorm_square

pytest.importorskip("onnxscript")


def test_a_decomposed_norm_is_named(tmp_path, ox):
    model, (x,) = rmsnorm_square()
    # the mechanism, in real FP16: the square inside the RMS overflows, the norm does not
    h = model.proj(x).detach().half()
    assert torch.isinf(h * h).any() and torch.isfinite(model.norm(h.float()).half()).all()
    art = export(model, (x,), tmp_path / "rms.onnx")
    ops = [n.op_type for n in ox.onnx.load(str(art.path)).graph.node]
    assert "Pow" in ops and "ReduceMean" in ops
    (warning,) = [w for w in art.warnings if "decomposed" in w]
    assert "'norm'" in warning and "fp32_modules=['norm']" in warning


def test_layernorm_stays_one_node_without_warning(tmp_path, ox):
    model, inputs = layernorm_variance()
    art = export(model, inputs, tmp_path / "ln.onnx")
    nodes = ox.onnx.load(str(art.path)).graph.node
    (ln,) = [n for n in nodes if n.op_type == "LayerNormalization"]
    assert art.node_map[ln.name] == "norm"
    assert not any("decomposed" in w for w in art.warnings)
    assert art.opset >= 17


def test_torchscript_fallback_when_dynamo_fails(tmp_path, monkeypatch):
    from fp16lens.export import _torch_export

    def broken(*args, **kwargs):
        raise RuntimeError("torch.export cannot trace this model")

    monkeypatch.setattr(_torch_export, "_dynamo", broken)
    monkeypatch.setattr(_torch_export, "TORCH_VERSION", _torch_export.DYNAMO_FROM)
    model, inputs = gelu_span()
    art = export(model, inputs, tmp_path / "g.onnx", fp32_modules=["act"])
    assert art.exporter == "torchscript"
    assert "dynamo exporter failed" in art.warnings[0] and "TorchScript" in art.warnings[0]
    assert {art.node_map[n] for n in art.fp32_nodes} == {"act"}  # GELU as Erf, Mul, ... (opset 18)
    with pytest.raises(ExportError, match="exporter='torchscript'"):
        export(model, inputs, tmp_path / "g2.onnx", exporter="dynamo")


def test_reloaded_artifact_has_the_same_map(tmp_path):
    model, inputs = gelu_span()
    art = export(model, inputs, tmp_path / "g.onnx", fp32_modules=["act"], exporter="torchscript")
    again = ExportArtifact.load(art.path)
    assert again.node_map == art.node_map and again.precision == "fp16"
    assert again.exporter == "torchscript"
    for site in ("fc1", "act", "fc2", ""):
        assert again.tensor_for_site(site) == art.tensor_for_site(site) is not None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "bf16"}, "precision must be one of"),
        ({"io_dtype": "fp64"}, "io_dtype must be one of"),
        ({"opset": 16}, "opset must be an int >= 17"),
        ({"exporter": "jit"}, "exporter must be one of"),
        ({"fp32_modules": "act"}, "list of module names"),
        ({"max_fallback": 1.5}, r"max_fallback must be a share of the FLOPs in \[0, 1\]"),
        ({"max_fallback": "10%"}, "max_fallback must be a share"),
    ],
)
def test_options_name_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExportOptions(**kwargs)


def test_torch_without_the_dynamo_exporter_uses_torchscript_and_says_so(tmp_path, monkeypatch):
    """torch 2.4's ``export(dynamo=True)`` takes no ``external_data``: ``auto`` goes to the
    TorchScript exporter with a note naming the torch release, ``dynamo`` is refused in
    one line that names the way out."""
    from fp16lens.export import _torch_export

    monkeypatch.setattr(_torch_export, "TORCH_VERSION", (2, 4))
    monkeypatch.setattr(_torch_export, "_dynamo", lambda *a, **k: pytest.fail("dynamo ran"))
    model, inputs = gelu_span()
    art = export(model, inputs, tmp_path / "g.onnx")
    assert art.exporter == "torchscript"
    assert "torch 2.5 and later" in art.warnings[0] and "TorchScript" in art.warnings[0]
    with pytest.raises(ExportError, match="exporter='torchscript'") as err:
        export(model, inputs, tmp_path / "g2.onnx", exporter="dynamo")
    assert "\n" not in str(err.value)


def test_the_torchscript_export_leaves_no_temporary_files(tmp_path, monkeypatch):
    """The TorchScript exporter writes through a temporary folder (a model over 2 GB goes
    only to a path, its weights beside it; scripts/check_large_onnx.py exports one): the
    folder is gone afterwards, and the file holds every weight, none external."""
    import tempfile

    onnx = pytest.importorskip("onnx")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    model, inputs = gelu_span()
    art = export(model, inputs, tmp_path / "g.onnx", "fp32", exporter="torchscript")
    assert list((tmp_path / "tmp").iterdir()) == []
    proto = onnx.load(str(art.path), load_external_data=False)
    weights = {t.name: t for t in proto.graph.initializer}
    assert weights and all(t.data_location == onnx.TensorProto.DEFAULT for t in weights.values())
    expected = sum(p.numel() for p in model.parameters())
    assert sum(int(np.prod(t.dims)) for t in weights.values()) >= expected


def test_max_fallback_needs_an_int8_target(tmp_path):
    """max_fallback bounds a target's fallback: without target= it is refused, in one line
    naming the fix, before anything is exported."""
    model, (x,) = gelu_span()
    with pytest.raises(ExportError, match=r"give target= too") as caught:
        export(model, x, tmp_path / "m.onnx", "int8", calibration=[x], max_fallback=0.25)
    assert len(str(caught.value).splitlines()) == 1
    assert not (tmp_path / "m.onnx").exists()
