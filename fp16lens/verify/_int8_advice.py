"""Why an INT8 (Q/DQ) graph fails parity: the activations whose quantization loses most.

First the Q/DQ graph is run as written (no ONNX Runtime fusions): when it passes, the
quantization holds and the loss is ONNX Runtime's fused INT8 kernels. Otherwise each
activation QuantizeLinear -> DequantizeLinear pair is switched on alone (the others pass
FP32 values): the output cosine to FP32 then says what that one quantizer costs (clipping
beyond the calibrated range, or a range so wide, by one outlier channel, that the values
that matter fall into a few levels). Every pair is measured, in one session: each pair's
output reads ``x + on[k]·(DQ(Q(x)) − x)`` with ``on`` fed one-hot. The layers reading the
worst ones are named, with what to try.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fp16lens.verify._onnx_ref import OnnxReference

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
UNIT_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
"""The layers an INT8 export quantizes (its units): those ``fp32_nodes`` keeps out of INT8."""
TOP = 5
SWITCH = "fp16lens_qdq_on"


@dataclass(frozen=True)
class Cost:
    """One activation quantizer: the layers on both sides of it and the output cosine to
    FP32 with only it quantized."""

    producer: str | None
    readers: tuple[str, ...]
    cosine: float
    tensor: str = ""  # the DequantizeLinear output of the pair

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*([self.producer] if self.producer else []), *self.readers]))

    def __str__(self) -> str:
        return f"{self.producer or 'the input'} -> {', '.join(self.readers)} ({self.cosine:.4f})"


_F16 = 10  # onnx.TensorProto.FLOAT16
Items = list  # of (batch, the FP32 model's named outputs on it)


def sensitivities(runner, items: Items, about_mean: bool = True) -> list[Cost]:
    """Each activation quantizer switched on alone, worst first (weights stay quantized:
    the ONNX file holds no FP32 copy of them), judged over ``items`` together."""
    from fp16lens.verify._onnx_graph import producers
    from fp16lens.verify._onnx_sites import site_of_node

    made = producers(runner.proto)
    pairs = _activation_pairs(runner.proto.graph)
    if not pairs:
        return []
    sess = _switched_session(runner.proto, [y for _, y, _ in pairs])
    costs = []
    for k, (x, y, readers) in enumerate(pairs):
        on = np.zeros(len(pairs), np.float32)
        on[k] = 1.0
        cosine = _cosine_of(runner, sess, items, about_mean, {SWITCH: on})
        node: Any = made.get(x)
        producer = (site_of_node(node, runner.model) or node.name) if node is not None else None
        names = [site_of_node(r, runner.model) or r.name for r in readers] or ["the output"]
        costs.append(
            Cost(producer, tuple(dict.fromkeys(names)), 1.0 if cosine is None else cosine, y)
        )
    return sorted(costs, key=lambda c: c.cosine)


def int8_advice(
    runner, items: Items, min_cosine: float, about_mean: bool = True, top: int = TOP
) -> tuple[str, ...]:
    """What to try after a failed INT8 check on ``items`` (batches, each with the FP32
    model's named outputs on it: the first batch that failed, or those that fail only
    together, a score judged about its mean over them): when the Q/DQ graph computed as
    written passes, the loss is ONNX Runtime's fused INT8 kernels; else the ``top``
    costliest activation quantizers,
    and the modules to keep out of INT8 (both sides of a quantizer: a tensor stays FP32
    only when its producer and its readers are excluded), or for an ONNX reference the
    nodes reading them (an export of an ONNX source places Q/DQ at its layers' inputs
    only, so keeping the readers out keeps the tensor FP32 for them)."""
    unfused = unfused_cosine(runner, items, about_mean)
    if unfused is not None and unfused >= min_cosine:
        return (
            f"the Q/DQ graph computed as written (each QuantizeLinear/DequantizeLinear on its "
            f"own, ONNX Runtime's Q/DQ fusions off) reaches cosine {unfused:.6f} >= "
            f"{min_cosine}: the quantization itself holds; the loss comes from ONNX Runtime's "
            "fused CPU INT8 kernels (QLinearConv, QLinearAdd, QGemm, ...), which TensorRT does "
            "not run; check on the target with backend 'tensorrt'",
        )
    ranked = [c for c in sensitivities(runner, items, about_mean) if c.cosine < 1.0][:top]
    if not ranked:
        return ()
    lines = [
        f"the INT8 activations that cost most (producer -> readers, output cosine with only "
        f"that activation quantized): {'; '.join(map(str, ranked))}",
        "try: more and more representative calibration batches (calibration=[...] / "
        "--calibration FILE); weights are already quantized per channel",
    ]
    failing = [c for c in ranked if c.cosine < min_cosine] or ranked[:1]
    modules = (
        {n for n, _ in runner.model.named_modules() if n} if runner.model is not None else set()
    )
    names = list(dict.fromkeys(m for c in failing for m in c.layers if m in modules))
    if names:
        lines.append(
            f"or keep them out of INT8: fp16lens export ... --precision int8 --fp32-modules "
            f"{','.join(names)} (Python: fp32_modules={names!r})"
        )
    elif isinstance(runner.model, OnnxReference):  # an ONNX source: its layers are nodes
        units = {n.name for n in runner.proto.graph.node if n.op_type in UNIT_OPS}
        nodes = list(dict.fromkeys(r for c in failing for r in c.readers if r in units))
        if nodes:
            lines.append(
                f"or keep them out of INT8: fp16lens export SOURCE.onnx --precision int8 "
                f"--fp32-nodes {','.join(nodes)} (Python: fp32_nodes={nodes!r})"
            )
    return tuple(lines)


def unfused_cosine(runner, items: Items, about_mean: bool = True) -> float | None:
    """Worst cosine to FP32 of the Q/DQ graph run without graph optimizations."""
    return _cosine(runner, runner.proto, items, about_mean)


def _cosine(runner, proto, items: Items, about_mean: bool = True) -> float | None:
    """Worst output cosine to FP32 of ``proto`` run as written (no fusions)."""
    from fp16lens.verify._onnx import session

    return _cosine_of(runner, session(_stored(proto), optimize=False), items, about_mean)


def _stored(proto):
    """``proto`` as it runs: where it types float parts FP16, computed in FP32 with each
    FP16 tensor rounded to FP16 after the node that writes it (``fp32_compute``)."""
    from fp16lens.verify._onnx_graph import fp32_compute, tensor_types

    return fp32_compute(proto, True) if _F16 in tensor_types(proto).values() else proto


def _cosine_of(
    runner, sess, items: Items, about_mean: bool, extra: dict | None = None
) -> float | None:
    """The worst float output's cosine over ``items`` together, or (``about_mean``, as the
    check's tolerance says) its cosine about FP32's mean where that is lower."""
    from fp16lens.verify._metrics import Accumulator, worst

    names = [i.name for i in sess.get_inputs() if i.name != SWITCH]
    accs: dict[int, Accumulator] = {}
    for batch, reference in items:
        outs = sess.run(None, {**runner.feed(batch, names), **(extra or {})})
        if len(outs) != len(reference):
            return None
        for i, ((_, ref), out) in enumerate(zip(reference, outs)):
            if ref.is_floating_point():
                got = torch.from_numpy(np.asarray(out)).to(ref.dtype)
                accs.setdefault(i, Accumulator()).update(
                    ref.detach().cpu(), got, runner.free_axes(i)
                )
    results = [a.result() for a in accs.values()]
    about = [m.cosine_about_mean for m in results] if about_mean else []
    return worst([*(m.cosine for m in results), *about])


def _activation_pairs(graph) -> list[tuple[str, str, list]]:
    """(tensor quantized, tensor dequantized, nodes reading the latter) per activation pair."""
    initializers = {i.name for i in graph.initializer}
    quantized = {n.output[0]: n for n in graph.node if n.op_type == "QuantizeLinear"}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    pairs = []
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        q = quantized.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if q is None or q.input[0] in initializers:
            continue
        users = [r for r in readers.get(node.output[0], []) if r.op_type not in QDQ_OPS]
        if users or node.output[0] in outputs:  # a quantized model output has no reader
            pairs.append((q.input[0], node.output[0], users))
    return pairs


def _switched_session(proto, dequantized: list[str]):
    """One session of ``proto`` where the k-th activation pair (``dequantized[k]``, a
    DequantizeLinear output) is on only where input ``SWITCH``'s k-th value is 1."""
    from fp16lens._core import import_optional
    from fp16lens.verify._onnx import session

    onnx = import_optional("onnx", "onnx", "running an ONNX candidate")
    helper, numpy_helper = onnx.helper, onnx.numpy_helper
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    g = model.graph
    index = {y: k for k, y in enumerate(dequantized)}
    made = {n.output[0]: n for n in g.node if n.op_type == "QuantizeLinear"}
    g.input.append(
        helper.make_tensor_value_info(SWITCH, onnx.TensorProto.FLOAT, [len(dequantized)])
    )
    scales = {i.name: i.data_type for i in g.initializer}
    nodes = []
    for node in g.node:
        nodes.append(node)
        k = index.get(node.output[0]) if node.op_type == "DequantizeLinear" else None
        if k is None:
            continue
        x, y = made[node.input[0]].input[0], node.output[0]
        node.output[0] = f"{y}__dq"
        g.initializer.append(numpy_helper.from_array(np.array(k, np.int64), f"{y}__k"))
        on = [helper.make_node("Gather", [SWITCH, f"{y}__k"], [f"{y}__on"])]
        if scales.get(node.input[1]) == _F16:  # a DequantizeLinear writing FP16
            on[0].output[0] = f"{y}__on32"
            on.append(helper.make_node("Cast", [f"{y}__on32"], [f"{y}__on"], to=_F16))
        nodes += [
            *on,
            helper.make_node("Sub", [f"{y}__dq", x], [f"{y}__d"]),
            helper.make_node("Mul", [f"{y}__d", f"{y}__on"], [f"{y}__m"]),
            helper.make_node("Add", [x, f"{y}__m"], [y]),
        ]
    del g.node[:]
    g.node.extend(nodes)
    return session(_stored(model), optimize=False)
