"""TensorRT backends, thin: Polygraphy's TrtRunner on the exported ONNX (``tensorrt``) and
torch-tensorrt on the module (``torch-tensorrt``). Both need a CUDA GPU.

The ONNX artifact is already typed (FP16 tensors, Casts around FP32 islands; or Q/DQ
for INT8), so the network is built strongly typed -- the only form TensorRT 11 accepts,
and supported by TensorRT 10. A failing run is localized on the same artifact by the
``onnx-fp16`` storage emulation (marking every tensor as a TensorRT output would
disable the fusions being verified).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fp16lens._core import VerifyError, import_optional
from fp16lens._core.sites import Backend
from fp16lens.verify._onnx import OnnxRunner
from fp16lens.verify._torch import TorchFp16, tensor_leaves


def _require_cuda(backend: Backend) -> None:
    if not torch.cuda.is_available():
        raise VerifyError(
            f"backend {str(backend)!r} needs a CUDA GPU; on a CPU use "
            f"{str(Backend.ONNX_FP16)!r} or {str(Backend.TORCH_EMULATED)!r}"
        )


class TensorRTRunner(OnnxRunner):
    """Builds a strongly typed engine from the ONNX file and runs it with Polygraphy."""

    name = Backend.TENSORRT
    LOCALIZED = "localized with the onnx-fp16 storage emulation of the same artifact"

    def _notes(self) -> tuple[str, ...]:  # the artifact's own notes, and how divergence is found
        return (*super()._notes(), self.LOCALIZED)

    def __init__(self, path: str | Path, model: nn.Module | None = None):
        import_optional("tensorrt", "trt", "the tensorrt backend")
        import_optional("polygraphy", "trt", "the tensorrt backend")
        _require_cuda(self.name)
        super().__init__(path, model)
        from polygraphy.backend.trt import (
            CreateConfig,
            EngineFromNetwork,
            NetworkFromOnnxPath,
            TrtRunner,
        )

        network = NetworkFromOnnxPath(str(self.path), strongly_typed=True)
        self.runner = TrtRunner(EngineFromNetwork(network, config=CreateConfig()))
        self.runner.activate()
        self.input_names = [i.name for i in self.proto.graph.input]
        self.output_names = [o.name for o in self.proto.graph.output]

    def run(self, batch: tuple) -> list[torch.Tensor]:
        feed = {n: self._typed(n, a) for n, a in self.feed(batch, self.input_names).items()}
        outs = self.runner.infer(feed)
        return [torch.from_numpy(np.array(outs[n])) for n in self.output_names]

    def _typed(self, name: str, array: np.ndarray) -> np.ndarray:
        return array.astype(np.float16) if self.types.get(name) == 10 else array

    def __del__(self):
        runner = getattr(self, "runner", None)
        if runner is not None and getattr(runner, "is_active", False):
            runner.deactivate()


class TorchTensorRTRunner(TorchFp16):
    """``torch_tensorrt.compile`` of the half-precision candidate on the GPU; a failing
    run is localized with the torch-fp16 backend on the same device."""

    name = Backend.TORCH_TENSORRT
    notes = ("localized with the torch-fp16 backend",)

    def __init__(self, candidate: nn.Module):
        self.torch_trt = import_optional("torch_tensorrt", "torchtrt", "the torch-tensorrt backend")
        _require_cuda(self.name)
        super().__init__(copy.deepcopy(candidate).cuda())
        self.compiled: Callable | None = None

    def run(self, batch: tuple) -> list[torch.Tensor]:
        inputs = self._inputs(batch)
        if self.compiled is None:
            tensors = [a for a in inputs if torch.is_tensor(a)]
            self.compiled = self.torch_trt.compile(
                self.model, ir="dynamo", inputs=tensors, enabled_precisions={torch.float16}
            )
        with torch.no_grad():
            return tensor_leaves(self.compiled(*inputs))
