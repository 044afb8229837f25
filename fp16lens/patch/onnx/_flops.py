"""How much of an ONNX graph's conv/gemm/matmul arithmetic a plan leaves in FP16: the graph
counterpart of ``patch/_flops.py``."""

from __future__ import annotations

from collections.abc import Iterable

from fp16lens.patch.onnx._graph import attr

WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def _outputs(op: str, dims: list[int], node) -> int:
    """Output channels of a weight: what each output element's multiply-adds divide by."""
    if op == "Conv":
        return dims[0]
    if op == "ConvTranspose":
        return dims[1] * (attr(node, "group", 1) or 1)
    if op == "Gemm":
        return dims[0] if attr(node, "transB", 0) else dims[-1]
    return dims[-1]  # MatMul by a constant [K, N]


def graph_flops(proto, report, fp32: Iterable[str]) -> tuple[float, float]:
    """(FLOPs left in FP16, total FLOPs) of the Conv/ConvTranspose/Gemm/MatMul nodes with a
    constant weight over the scanned batches: 2 x output elements (the report's count) x
    multiply-adds per output element (the weight's size over its output channels). A node
    named in ``fp32`` runs in FP32. A MatMul of two computed tensors (attention) is not
    counted: its size is not in the graph."""
    weights = {t.name: list(t.dims) for t in proto.graph.initializer}
    kept = set(fp32)
    fp16 = total = 0.0
    for node in proto.graph.node:
        dims = (
            weights.get(node.input[1]) if node.op_type in WEIGHTED and len(node.input) > 1 else None
        )
        st = report.sites.get(node.name)
        if not dims or st is None:
            continue
        size = 1
        for d in dims:
            size *= d
        flops = 2.0 * st.numel * size / max(_outputs(node.op_type, dims, node), 1)
        total += flops
        fp16 += 0.0 if node.name in kept else flops
    return fp16, total
