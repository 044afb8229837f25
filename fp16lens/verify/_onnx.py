"""The ONNX backends in ONNX Runtime (CPU provider): ``onnx-fp16`` runs the strongly typed
FP16 artifact with FP16 storage made real (see ``_onnx_graph``); ``onnx-int8`` runs the
Q/DQ graph as it is (ONNX Runtime executes QuantizeLinear/DequantizeLinear exactly), its
float parts, where the file types them FP16, with their FP16 storage made real too."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fp16lens._core import VerifyError, import_optional, onnx_large
from fp16lens._core.feeds import feed_items
from fp16lens._core.onnx_types import elem_types, in_order, read_file
from fp16lens._core.sites import Backend
from fp16lens.verify._align import first_departure
from fp16lens.verify._onnx_graph import float_tensors, fp32_compute, producers, tensor_types
from fp16lens.verify._onnx_sites import site_of_node
from fp16lens.verify._runner import Runner

_F16 = 10


def _ort():
    return import_optional("onnxruntime", "onnx", "running an ONNX candidate")


def session(proto, optimize: bool = False):
    """A CPU session; graph optimizations off unless asked (they would drop the storage Casts)."""
    ort = _ort()
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return onnx_large.session(ort, proto, options)


def load(path: str | Path):
    onnx = import_optional("onnx", "onnx", "running an ONNX candidate")
    # the first divergence is named in graph order
    missing = "export one with fp16lens.export(...)"
    return in_order(read_file(onnx, Path(path), VerifyError, missing))


class OnnxRunner(Runner):
    """Feeds torch batches to a graph and returns its outputs as FP32 torch tensors."""

    name = Backend.ONNX_FP16

    def __init__(self, path: str | Path, model: nn.Module | None = None):
        self.path = Path(path)
        self.proto = load(path)
        self.model = model
        self.types = tensor_types(self.proto)
        self._session = None
        self.notes = self._notes()

    def _notes(self) -> tuple[str, ...]:
        if _F16 in self.types.values():
            return ()
        return (
            f"{self.path.name} holds no FP16 tensor, so FP16 storage was not checked; "
            "export it with fp16lens.export(..., precision='fp16')",
        )

    def feed(self, batch: tuple, names: list[str]) -> dict[str, np.ndarray]:
        if len(batch) == 1 and isinstance(batch[0], Mapping):  # by input name
            items = feed_items(batch[0], names, VerifyError, self.path.name)
            return {n: self._array(n, torch.as_tensor(a)) for n, a in items}
        tensors = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in batch]
        tensors = [a for a in tensors if torch.is_tensor(a)]
        if len(tensors) != len(names):
            raise VerifyError(
                f"{self.path.name} takes {len(names)} input(s) ({', '.join(names)}) but the batch "
                f"holds {len(tensors)} tensor(s); pass the inputs the model was exported with"
            )
        return {n: self._array(n, t) for n, t in zip(names, tensors)}

    def _array(self, name: str, t: torch.Tensor) -> np.ndarray:
        t = t.detach().cpu()
        if t.is_floating_point():
            t = t.half() if self.types.get(name) == _F16 else t
            return t.float().numpy()
        return t.numpy()

    def _sess(self):
        if self._session is None:
            self._session = self.build(round_storage=True, expose=None)
        return self._session

    def build(self, round_storage: bool, expose: list[str] | None):
        return session(fp32_compute(self.proto, round_storage, expose))

    def free_axes(self, output: int) -> frozenset[int]:
        """The axes of graph output ``output`` declared without a fixed length."""
        outputs = self.proto.graph.output
        if output >= len(outputs) or not outputs[output].type.HasField("tensor_type"):
            return frozenset()
        dims = outputs[output].type.tensor_type.shape.dim
        return frozenset(  # -1, as some exporters write, is free too
            i for i, d in enumerate(dims) if not d.HasField("dim_value") or d.dim_value <= 0
        )

    def run(self, batch: tuple) -> list[torch.Tensor]:
        sess = self._sess()
        names = [i.name for i in sess.get_inputs()]
        outs = sess.run(None, self.feed(batch, names))
        return [torch.from_numpy(np.asarray(o)) for o in outs]

    def locate(self, batch: tuple, site_rel: float) -> tuple[str | None, str | None]:
        """The first stored tensor departing from the same graph computed in FP32 without
        rounding: (its site, or the tensor name when unmapped; the tensor name)."""
        tensors = float_tensors(self.proto, self.types)
        ref, cand = (self._all(batch, r, tensors) for r in (False, True))
        tensor = first_departure(ref, cand, site_rel)
        if tensor is None:
            return None, None
        node = producers(self.proto).get(tensor)
        return (site_of_node(node, self.model) if node is not None else None) or tensor, tensor

    def _all(self, batch: tuple, round_storage: bool, tensors: list[str]):
        sess = self.build(round_storage, tensors)
        names = [i.name for i in sess.get_inputs()]
        outs = dict(
            zip([o.name for o in sess.get_outputs()], sess.run(None, self.feed(batch, names)))
        )
        return [
            (t, torch.from_numpy(np.asarray(outs[t], dtype=np.float32)))
            for t in tensors
            if t in outs
        ]


class OnnxInt8(OnnxRunner):
    """The Q/DQ graph computed as written: every QuantizeLinear/DequantizeLinear on its own,
    ONNX Runtime's Q/DQ fusions off. That is the quantization's own arithmetic, as TensorRT
    computes it (int8 products, exact int32 sums); ONNX Runtime's fused CPU INT8 kernels
    (QLinearConv, QGemm) saturate u8·s8 pairs on CPUs without VNNI and lose accuracy that
    the target never loses (the clean test model: cosine 0.946 fused, 0.999996 as written)."""

    name = Backend.ONNX_INT8

    def _notes(self) -> tuple[str, ...]:
        if any(n.op_type == "QuantizeLinear" for n in self.proto.graph.node):
            return ()
        return (f"{self.path.name} holds no QuantizeLinear node; export it with precision='int8'",)

    def build(self, round_storage: bool, expose: list[str] | None):
        proto = self.proto
        if _F16 in self.types.values():  # float parts typed FP16: their storage made real
            proto = fp32_compute(proto, round_storage)
        if expose is None:
            return session(proto, optimize=False)
        return session(expose_all(proto, expose, dequantize_only=not round_storage))


def expose_all(proto, tensors: list[str], dequantize_only: bool):
    """A copy exposing ``tensors``; with ``dequantize_only`` activation Q/DQ pairs are
    bypassed (the FP32 reference of the same graph: weights stay as quantized)."""
    onnx = import_optional("onnx", "onnx", "running an ONNX candidate")
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    if dequantize_only:
        _bypass_qdq(model.graph)
    present = {o.name for o in model.graph.output}
    missing = [name for name in tensors if name not in present]
    # each as its own type: a graph with FP16 storage made real holds FP16 tensors
    elem = elem_types(model, onnx) if missing else {}
    for name in missing:
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem.get(name, 1), None))
    return model


def _bypass_qdq(graph) -> None:
    """DequantizeLinear(QuantizeLinear(x)) -> Identity(x) for activations."""
    made = {n.output[0]: n for n in graph.node if n.op_type == "QuantizeLinear"}
    for node in graph.node:
        q = made.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if q is not None:
            node.op_type = "Identity"
            del node.input[:]
            node.input.append(q.input[0])
            del node.attribute[:]
