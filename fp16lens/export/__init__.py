"""Deployment: typed ONNX (FP32 / strongly typed FP16 / INT8 Q/DQ), TensorRT, torch-tensorrt.

``export`` writes the ONNX file and returns an ``ExportArtifact`` (node <-> module map,
FP32 islands, warnings); given an FP32 ONNX file instead of a model it re-types that
graph (FP32 islands: the nodes a patched file records in ``fp16lens.fp32_nodes``, plus
``fp32_nodes=``); ``build_engine`` turns it into a TensorRT plan (the ``trt`` extra);
``compile_torch_tensorrt`` compiles with torch-tensorrt (the ``torchtrt`` extra).
Nothing here imports onnx, ONNX Runtime or TensorRT until a function needs it.
"""

from fp16lens._core import ExportError
from fp16lens._core.callable_module import StageModule, stage_module
from fp16lens.export._artifact import ExportArtifact
from fp16lens.export._calib_cache import read_calibration_cache, write_calibration_cache
from fp16lens.export._engine_config import EngineConfig, engine_config
from fp16lens.export._export import export, retype
from fp16lens.export._int8_metrics import ctc_margin, mean_cosine, top1_margin, worst_sqnr
from fp16lens.export._int8_search import Target as Int8Target
from fp16lens.export._options import ExportOptions
from fp16lens.export._torchtrt import compile_torch_tensorrt, half_with_islands
from fp16lens.export._trt import build_engine

__all__ = [
    "EngineConfig",
    "ExportArtifact",
    "ExportError",
    "ExportOptions",
    "Int8Target",
    "build_engine",
    "compile_torch_tensorrt",
    "ctc_margin",
    "engine_config",
    "export",
    "half_with_islands",
    "mean_cosine",
    "read_calibration_cache",
    "retype",
    "top1_margin",
    "worst_sqnr",
    "write_calibration_cache",
]


class _Export(StageModule):
    """``fp16lens.export``: the package, callable as ``export(model, inputs, path, ...)``."""

    __call__ = staticmethod(export)
    retype = staticmethod(retype)
    build_engine = staticmethod(build_engine)
    compile_torch_tensorrt = staticmethod(compile_torch_tensorrt)
    ExportArtifact = ExportArtifact
    ExportError = ExportError
    ExportOptions = ExportOptions


entry = stage_module(__name__, _Export, export)
