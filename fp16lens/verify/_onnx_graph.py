"""The strongly typed FP16 ONNX graph rewritten so that FP16 storage is real on a CPU.

ONNX Runtime's CPU provider has no FP16 kernel for most ops: it wraps them in Casts and
computes whole regions in FP32, removing the Casts between them, so an intermediate
beyond 65504 stays finite and the overflow is hidden. This rewrite makes every node
compute in FP32 from its (FP16-valued) inputs and store each output that the artifact
types FP16 through an explicit Cast to FP16 and back -- a lossy pair that a session with
graph optimizations disabled (``ORT_DISABLE_ALL``) keeps. FP32 islands (outputs the
artifact types FP32) are not rounded. Initializers are FP16 values held in FP32, exactly.

What it models: range and rounding of every stored tensor (op outputs, weights, inputs),
hence overflow at the first op whose output leaves FP16 and its propagation, and the
internal overflow of decomposed ops (each node of a decomposed LayerNorm stores its
output). What it does not model: accumulation precision inside one op (a Conv, MatMul,
ReduceSum or pooling sums in FP32 here; TensorRT's FP16 kernels also accumulate in
FP32 for most tactics, but not all), kernel fusions (a fused pre-activation is stored
here), and ops in subgraphs (If/Loop bodies are left as they are).
"""

from __future__ import annotations

from fp16lens._core import import_optional, onnx_large

ROUND_SUFFIX = "__fp16lens_compute"
_F16, _F32 = 10, 1  # onnx.TensorProto.FLOAT16 / FLOAT


def _onnx():
    return import_optional("onnx", "onnx", "running an ONNX candidate")


def tensor_types(proto) -> dict[str, int]:
    """Element type of every tensor the graph declares or shape inference can tell."""
    onnx = _onnx()
    inferred = onnx_large.infer_shapes(onnx, proto)
    g = inferred.graph
    types = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for node in g.node:
        if node.op_type == "Cast":
            types[node.output[0]] = next(a.i for a in node.attribute if a.name == "to")
    return types


def float_tensors(proto, types: dict[str, int]) -> list[str]:
    """Every node output typed FP16 or FP32, in graph order (the candidates for comparison)."""
    return [o for n in proto.graph.node for o in n.output if o and types.get(o) in (_F16, _F32)]


def fp32_compute(proto, round_storage: bool, expose: list[str] | None = None):
    """A copy of an FP16 graph computing in FP32; with ``round_storage`` every output the
    original types FP16 is rounded to FP16 and back; ``expose`` adds tensors as outputs."""
    onnx = _onnx()
    types = tensor_types(proto)
    model = onnx_large.replacing(proto, _widened)  # the FP16 values are not copied in first
    g = model.graph
    nodes = []
    for node in g.node:
        _widen_attributes(node)
        nodes.append(node)
        if round_storage:
            nodes.extend(_round_outputs(node, types))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    for vi in (*g.input, *g.output):
        if vi.type.tensor_type.elem_type == _F16:
            vi.type.tensor_type.elem_type = _F32
    present = {o.name for o in g.output}
    for name in expose or ():
        if name not in present:
            g.output.append(onnx.helper.make_tensor_value_info(name, _F32, None))
    return model


def _round_outputs(node, types: dict[str, int]) -> list:
    helper = _onnx().helper
    extra = []
    for i, out in enumerate(node.output):
        if out and types.get(out) == _F16:
            raw = f"{out}{ROUND_SUFFIX}"
            node.output[i] = raw
            extra.append(
                helper.make_node(
                    "Cast", [raw], [f"{out}__fp16lens_h"], to=_F16, name=f"{out}__fp16lens_store"
                )
            )
            extra.append(
                helper.make_node(
                    "Cast", [f"{out}__fp16lens_h"], [out], to=_F32, name=f"{out}__fp16lens_load"
                )
            )
    return extra


def _widened(init):
    """An FP16 initializer as FP32 holding the same values (None: not FP16)."""
    if init.data_type != _F16:
        return None
    numpy_helper = _onnx().numpy_helper
    return numpy_helper.from_array(numpy_helper.to_array(init).astype("float32"), init.name)


def _widen_attributes(node) -> None:
    """Cast-to-FP16 becomes Cast-to-FP32 (storage is rounded after the node); FP16
    constants become FP32 constants holding the same values."""
    numpy_helper = _onnx().numpy_helper
    for attr in node.attribute:
        if node.op_type == "Cast" and attr.name == "to" and attr.i == _F16:
            attr.i = _F32
        elif attr.HasField("t") and attr.t.data_type == _F16:
            attr.t.CopyFrom(
                numpy_helper.from_array(
                    numpy_helper.to_array(attr.t).astype("float32"), attr.t.name
                )
            )


def producers(proto) -> dict[str, object]:
    """Tensor name -> the node producing it."""
    return {o: n for n in proto.graph.node for o in n.output if o}
