"""Element types of an ONNX graph's tensors (the scan and the ONNX patch read them)."""

from __future__ import annotations


def elem_types(proto, onnx) -> dict[str, int]:
    """Tensor name -> ONNX element type, from shape inference where it runs, else from the
    declared types (custom ops); ``onnx``: the imported module (an optional dependency)."""
    try:
        g = onnx.shape_inference.infer_shapes(proto).graph
    except Exception:  # unknown custom ops: declared types only
        g = proto.graph
    elem = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        if vi.type.HasField("tensor_type"):
            elem[vi.name] = vi.type.tensor_type.elem_type
    return elem
