"""build_engine(): a TensorRT plan from an exported ONNX file, through Polygraphy's loaders."""

from __future__ import annotations

import tempfile
from pathlib import Path

from fp16lens._core import import_optional
from fp16lens.export._calib_cache import retag_cache
from fp16lens.export._engine_config import EngineConfig, engine_config, layers_to_pin
from fp16lens.export._onnx_meta import fp16_rest_holds, fp32_nodes_of, has_qdq

_PURPOSE = "building a TensorRT engine"


def build_engine(
    onnx_path: str | Path,
    plan_path: str | Path,
    precision: str = "fp16",
    *,
    fp32_nodes: list[str] | None = None,
    calibration_cache: str | Path | None = None,
    strongly_typed: bool | None = None,
    workspace_bytes: int | None = None,
) -> Path:
    """Build and save a TensorRT engine from ``onnx_path``; returns ``plan_path``.

    Strongly typed on TensorRT >= 10.12 (the types come from the ONNX file); weakly typed
    before, with the FP32 islands recorded in the file (or ``fp32_nodes``) pinned to FP32
    and ``calibration_cache`` for INT8 without Q/DQ; an INT8 file whose check with its
    float parts in FP16 failed at export is built with FP16 off (INT8 and FP32).
    """
    trt = import_optional("tensorrt", "trt", _PURPOSE)
    pg = import_optional("polygraphy.backend.trt", "trt", _PURPOSE)
    onnx = import_optional("onnx", "onnx", _PURPOSE)
    model = onnx.load(str(onnx_path), load_external_data=False)
    nodes = fp32_nodes if fp32_nodes is not None else fp32_nodes_of(model)
    config = engine_config(
        precision,
        trt.__version__,
        nodes,
        calibration_cache,
        has_qdq(model),
        strongly_typed,
        fp16_rest_holds(model),
    )
    kwargs = {"strongly_typed": True} if config.strongly_typed else {}
    builder, network, parser = pg.network_from_onnx_path(str(onnx_path), **kwargs)
    _pin_fp32(trt, network, config)
    with tempfile.TemporaryDirectory() as tmp:
        create = pg.CreateConfig(
            fp16=config.fp16 or None,
            int8=config.int8 or None,
            precision_constraints=config.precision_constraints,
            calibrator=_calibrator(pg, config, trt.__version__, Path(tmp)),
            memory_pool_limits=_pools(trt, workspace_bytes),
        )
        engine = pg.engine_from_network((builder, network, parser), config=create)
    pg.save_engine(engine, str(plan_path))
    return Path(plan_path)


def _pin_fp32(trt, network, config: EngineConfig) -> None:
    if not config.fp32_layers:
        return
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    pinned = set(layers_to_pin([layer.name for layer in layers], config.fp32_layers))
    skip = {trt.LayerType.SHAPE, trt.LayerType.CONSTANT}
    for layer in layers:
        if layer.name not in pinned or layer.type in skip:
            continue
        layer.precision = trt.float32
        for i in range(layer.num_outputs):
            if layer.get_output(i).dtype in (trt.float32, trt.float16):
                layer.set_output_type(i, trt.float32)


def _calibrator(pg, config: EngineConfig, version: str, tmp: Path):
    """A Polygraphy calibrator that only reads the cache (retagged for this TensorRT)."""
    if config.calibration_cache is None:
        return None
    cache = tmp / "calibration.cache"
    cache.write_text(
        retag_cache(config.calibration_cache.read_text(encoding="utf-8"), version), encoding="utf-8"
    )
    return pg.Calibrator(data_loader=[], cache=str(cache))


def _pools(trt, workspace_bytes: int | None):
    if workspace_bytes is None:
        return None
    return {trt.MemoryPoolType.WORKSPACE: int(workspace_bytes)}
