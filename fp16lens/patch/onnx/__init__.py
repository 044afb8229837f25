"""patch() of an ONNX graph (``fp16lens.patch('model.onnx', report)``): the planner that
patches PyTorch models, reading the graph through ``OnnxBinding``; onnx and onnxruntime
are imported when a patch runs (extra ``onnx``)."""

from fp16lens._core.onnx_types import FP32_NODES_KEY
from fp16lens.patch.onnx._patch import fp32_nodes, patch_onnx, plan_onnx

__all__ = ["FP32_NODES_KEY", "fp32_nodes", "patch_onnx", "plan_onnx"]
