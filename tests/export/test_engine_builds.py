"""TensorRT and torch-tensorrt: the pure decisions here, the builds where a GPU is present."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from fp16lens.export import EngineConfig, ExportError, engine_config, half_with_islands
from fp16lens.export._engine_config import layers_to_pin

from models import first_inf_site_fp16, gelu_span, seed_case


def test_strongly_typed_from_tensorrt_10_12():
    assert engine_config("fp16", "10.12.0.36", ["n"]) == EngineConfig(strongly_typed=True)
    assert engine_config("int8", "11.0", has_qdq=True) == EngineConfig(strongly_typed=True)
    with pytest.raises(ExportError, match="Q/DQ"):
        engine_config("int8", "10.13", calibration_cache="c.cache")


def test_weakly_typed_before_10_12_pins_the_islands():
    config = engine_config("fp16", "10.3.0", ["node_gelu"])
    assert config == EngineConfig(
        strongly_typed=False,
        fp16=True,
        precision_constraints="obey",
        fp32_layers=("node_gelu",),
    )
    assert engine_config("fp16", "8.6.1").precision_constraints is None
    assert engine_config("fp32", "10.3", ["n"]) == EngineConfig(strongly_typed=False)


def test_weakly_typed_int8_uses_the_cache_or_qdq():
    config = engine_config("int8", "10.3.0", calibration_cache="m.cache")
    assert (config.int8, config.fp16, config.calibration_cache) == (True, True, Path("m.cache"))
    assert engine_config("int8", "10.3.0", has_qdq=True).calibration_cache is None
    with pytest.raises(ExportError, match="calibration_cache="):
        engine_config("int8", "10.3.0")


def test_weakly_typed_int8_leaves_fp16_off_where_its_float_parts_fail_in_fp16():
    """An INT8 file whose check with its float parts in FP16 failed at export (its
    metadata says so) is built with FP16 off, INT8 and FP32 as it was checked; where it
    held, or the file does not say, FP16 stays on beside INT8. Strongly typed builds take
    the types from the file either way."""
    from fp16lens.export._onnx_meta import FP16_REST_KEY, fp16_rest_holds

    failed = engine_config("int8", "10.3.0", has_qdq=True, fp16_rest=False)
    assert (failed.int8, failed.fp16) == (True, False)
    for holds in (True, None):
        assert engine_config("int8", "10.3.0", has_qdq=True, fp16_rest=holds).fp16
    assert engine_config("fp16", "10.3.0", fp16_rest=False).fp16  # an FP16 build is FP16
    typed = engine_config("int8", "10.12", has_qdq=True, fp16_rest=False)
    assert typed == EngineConfig(strongly_typed=True)
    onnx = pytest.importorskip("onnx")
    model = onnx.ModelProto()
    assert fp16_rest_holds(model) is None
    entry = model.metadata_props.add()
    entry.key, entry.value = FP16_REST_KEY, "fails 0.109981"
    assert fp16_rest_holds(model) is False
    entry.value = "holds 0.999990"
    assert fp16_rest_holds(model) is True


def test_tensorrt_11_has_no_weak_typing():
    with pytest.raises(ExportError, match="strongly typed"):
        engine_config("fp16", "11.0.0", strongly_typed=False)
    assert engine_config("fp16", "10.12", strongly_typed=False).fp16


def test_layers_named_after_the_nodes_are_pinned():
    layers = ["node_gelu", "node_gelu_1", "node_gelu_output", "node_gelux", "node_linear"]
    assert layers_to_pin(layers, ["node_gelu"]) == ["node_gelu", "node_gelu_1", "node_gelu_output"]


_PROBE = """
import json, sys
sys.modules["tensorrt"] = None
sys.modules["torch_tensorrt"] = None
import fp16lens.export
heavy = ("onnx", "onnxruntime", "onnxscript", "tensorrt", "torch_tensorrt", "polygraphy",
         "torchvision", "matplotlib")
loaded = [m for m in sys.modules if m.split(".")[0] in heavy and sys.modules[m] is not None]
import torch
from fp16lens import MissingDependencyError
from fp16lens.export import build_engine, compile_torch_tensorrt
errors = {}
for name, call in (
    ("trt", lambda: build_engine("model.onnx", "model.plan")),
    ("torchtrt", lambda: compile_torch_tensorrt(torch.nn.Linear(2, 2), (torch.ones(1, 2),))),
):
    try:
        call()
    except MissingDependencyError as exc:
        errors[name] = str(exc)
print(json.dumps({"loaded": loaded, "errors": errors}))
"""


@pytest.fixture(scope="module")
def probe():
    """One fresh interpreter with TensorRT and torch-tensorrt made unimportable."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_export_loads_no_heavy_dependency(probe):
    assert probe["loaded"] == []


def test_build_engine_without_tensorrt_names_the_extra(probe):
    assert "tensorrt is not installed" in probe["errors"]["trt"]
    assert "pip install -e '.[trt]'" in probe["errors"]["trt"]


def test_compile_torch_tensorrt_without_it_names_the_extra(probe):
    assert "torch_tensorrt is not installed" in probe["errors"]["torchtrt"]
    assert "pip install -e '.[torchtrt]'" in probe["errors"]["torchtrt"]


def test_islands_keep_the_seed_span_finite_in_real_fp16(seed):
    model, (x,) = seed
    assert first_inf_site_fp16(model, (x,)) is not None  # plain .half() overflows
    typed = half_with_islands(model, ["backbone.layer4.1", "neck.reduce_c5"])
    assert typed.neck.smooth[0].inner.weight.dtype == torch.float16
    assert typed.backbone.layer4[1].inner.bn2.weight.dtype == torch.float32
    with torch.no_grad():
        y, want = typed(x.half()), model(x)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), want, atol=5e-3, rtol=0)


@pytest.mark.tensorrt
def test_build_engine_from_typed_fp16_onnx(tmp_path):
    from polygraphy.backend.common import bytes_from_path
    from polygraphy.backend.trt import TrtRunner, engine_from_bytes

    from fp16lens.export import build_engine, export

    model, (x,) = gelu_span()
    model._fp16lens_plan = types.SimpleNamespace(fp32_modules=["fc1", "act", "fc2"])
    art = export(model, (x,), tmp_path / "gelu.onnx")
    plan = build_engine(art.path, tmp_path / "gelu.plan")
    with TrtRunner(engine_from_bytes(bytes_from_path(str(plan)))) as runner:
        (y,) = runner.infer({"x": x.numpy()}).values()
    np.testing.assert_allclose(y, model(x).detach().numpy(), rtol=1e-2, atol=1e-2)


@pytest.mark.torchtrt
def test_compile_torch_tensorrt_keeps_the_island():
    from fp16lens.export import compile_torch_tensorrt

    model, (x,) = seed_case()
    compiled = compile_torch_tensorrt(
        model, (x,), fp32_modules=["backbone.layer4.1", "neck.reduce_c5"]
    )
    y = compiled(x.half().cuda())
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float().cpu(), model(x).detach(), atol=5e-3, rtol=0)
