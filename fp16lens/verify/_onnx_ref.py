"""An FP32 ONNX file as verify's reference: the graph in ONNX Runtime (CPU), wrapped as an
``nn.Module`` whose forward returns ``{graph output name: tensor}``, so that the
comparison, the metrics and the output names are the ones a PyTorch reference gets."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fp16lens._core import VerifyError
from fp16lens._core.feeds import feed_items


class OnnxReference(nn.Module):
    """The FP32 graph run as it is (graph optimizations on: they do not change FP32 values
    beyond rounding, and the reference runs once per batch)."""

    def __init__(self, model):
        super().__init__()
        from fp16lens.verify._onnx import load, session

        proto = load(model) if isinstance(model, (str, Path)) else model
        self.name = Path(model).name if isinstance(model, (str, Path)) else "the ONNX model"
        _check_fp32(proto, self.name)
        self._session = session(proto, optimize=True)
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self._elem = {i.name: _elem(i.type) for i in self._session.get_inputs()}

    def forward(self, *batch) -> dict[str, torch.Tensor]:
        items = batch[0] if len(batch) == 1 and isinstance(batch[0], Mapping) else batch
        feed = {
            n: self._array(n, a)
            for n, a in feed_items(items, self.input_names, VerifyError, self.name)
        }
        outs = self._session.run(self.output_names, feed)
        return {n: torch.from_numpy(np.asarray(o)) for n, o in zip(self.output_names, outs)}

    def _array(self, name: str, a) -> np.ndarray:
        a = a.detach().cpu().numpy() if torch.is_tensor(a) else np.asarray(a)
        want = self._elem.get(name)
        return a.astype(want) if a.dtype.kind == "f" and want is not None else a

    def extra_repr(self) -> str:
        return f"{self.name}: inputs {', '.join(self.input_names)}"


def _elem(ort_type: str):
    """ONNX Runtime's ``tensor(float)`` -> numpy float32 (None for non-float inputs)."""
    return {
        "tensor(float)": np.float32,
        "tensor(float16)": np.float16,
        "tensor(double)": np.float64,
    }.get(ort_type)


def _check_fp32(proto, name: str) -> None:
    g = proto.graph
    if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in g.node) or any(
        i.data_type == 10 for i in g.initializer
    ):
        raise VerifyError(
            f"the reference {name} is not an FP32 graph (it holds FP16 or Q/DQ tensors); "
            "give the original FP32 model as reference and the converted file as candidate"
        )
