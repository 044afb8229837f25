"""ONNX in: scan an .onnx file (or an onnx.ModelProto) in ONNX Runtime into a Report.

onnx and onnxruntime are imported when a scan runs (extra ``onnx``)."""

from fp16lens.watch.onnx._scan import scan_onnx

__all__ = ["scan_onnx"]
