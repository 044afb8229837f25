"""What export records in the ONNX file for later stages (islands, Q/DQ), read back."""

from __future__ import annotations

from fp16lens.export._naming import MODULES_KEY

ISLANDS_KEY = "fp16lens.fp32_modules"
FP16_REST_KEY = "fp16lens.int8_float_parts_fp16"
"""An INT8 file's check with its float parts in FP16: "holds 0.999123" or "fails 0.95"."""


def fp32_modules_of(model) -> list[str]:
    """The FP32 islands export recorded in ``model``'s metadata."""
    meta = {p.key: p.value for p in model.metadata_props}
    return [m for m in meta.get(ISLANDS_KEY, "").split(",") if m]


def in_islands(modules, islands) -> bool:
    """Whether a node merged from ``modules`` lies in one of the ``islands`` (or below it)."""
    return any(m == i or m.startswith(f"{i}.") or i == "" for m in modules for i in islands)


def fp32_nodes_of(model) -> list[str]:
    """Names of the nodes of ``model`` that belong to a recorded FP32 island."""
    islands = fp32_modules_of(model)
    if not islands:
        return []
    out = []
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        if MODULES_KEY in meta and in_islands(meta[MODULES_KEY].split(","), islands):
            out.append(node.name)
    return out


def has_qdq(model) -> bool:
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def fp16_rest_holds(model) -> bool | None:
    """Whether export's check of ``model`` (an INT8 file) with its float parts in FP16
    passed; None where the file does not say (not checked on evaluation batches)."""
    meta = {p.key: p.value for p in model.metadata_props}
    said = meta.get(FP16_REST_KEY, "").split(" ")[0]
    return {"holds": True, "fails": False}.get(said)
