"""An INT8 file with its float parts typed FP16 (``export(..., float_parts="fp16")``).

The Q/DQ file export writes keeps every tensor that is not INT8 in FP32; a strongly typed
TensorRT build (10.12 and later, and TensorRT 11, which has no FP16 flag) computes those
parts in FP32 as the file types them. For FP16 beside INT8 on such a build the file itself
must type them FP16, as ModelOpt's default output does: opset 19 or later (the first where
QuantizeLinear reads and DequantizeLinear writes FP16 through an FP16 scale), every float
tensor FP16 but the FP32 nodes (``fp16lens.fp32_nodes``: the islands patch made), Casts
where the two meet. The conversion is the FP16 export's own (``_fp16.convert_fp16``: each
node typed from its schema, initializers range-checked), so the Q/DQ scales, biases and the
float ops between the INT8 layers become FP16; the INT8 weights stay INT8.

Such a file is checked like every file export writes: by verify's ``onnx-int8`` backend,
which computes it with its FP16 storage made real (``verify/_onnx.py``), against the FP32
reference; where that check fails, export fails and the FP32 float parts stay.
"""

from __future__ import annotations

import numpy as np

from fp16lens._core import ExportError, import_optional
from fp16lens.export._artifact import default_opset

QDQ_FP16_OPSET = 19
"""The first opset where QuantizeLinear/DequantizeLinear take an FP16 scale."""

FP16_TINIEST = np.float32(2.0**-24)
"""FP16's smallest positive value: no scale the typed file stores is below it."""


def typed_fp16(proto, io_dtype: str) -> tuple[object, list[str]]:
    """``proto`` (an INT8 Q/DQ file, FP32 float parts) with its float parts FP16: a new
    ModelProto and the conversion's notes. An opset below 19 is raised to 19 first; where
    ONNX's version converter cannot, one line says so."""
    from fp16lens.export._fp16 import convert_fp16
    from fp16lens.export._int8_equalize import centring_adds
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._naming import map_nodes
    from fp16lens.patch.onnx import fp32_nodes

    onnx = import_optional("onnx", "onnx", "ONNX export")
    opset = default_opset(proto)
    notes = []
    islands = set(fp32_nodes(proto))  # read first: the version converter drops metadata
    meta = [(p.key, p.value) for p in proto.metadata_props]
    stamps = {n.name: [(p.key, p.value) for p in n.metadata_props] for n in proto.graph.node}
    if opset < QDQ_FP16_OPSET:
        try:
            proto = onnx.version_converter.convert_version(proto, QDQ_FP16_OPSET)
        except Exception as exc:
            said = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise ExportError(
                f"float_parts='fp16' needs opset {QDQ_FP16_OPSET} (FP16 Q/DQ scales); ONNX's "
                f"version converter cannot raise this graph's opset {opset} ({said}): keep "
                "float_parts='fp32' (TensorRT 10.12 and later compute them in FP32)"
            ) from exc
        notes.append(f"opset {opset} raised to {QDQ_FP16_OPSET} for the FP16 Q/DQ scales")
    else:
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        proto = copy
    name_nodes(proto.graph)  # the converter's own nodes come unnamed; islands go by name
    wide = beyond_fp16(proto)
    if wide:  # as TensorRT's parser folds a batch norm: its parameters stay FP32
        islands |= set(wide)
        notes.append(
            f"{len(wide)} node(s) read an initializer beyond FP16 and stay FP32 in the typed "
            f"file: {', '.join(wide[:4])}{' ...' if len(wide) > 4 else ''}"
        )
    shifts = [n for n in centring_adds(proto.graph) if n not in islands]
    if shifts:  # FP16 would move each channel's values on the INT8 grid by one offset
        islands |= set(shifts)
        notes.append(
            f"{len(shifts)} centring add(s) right before a quantizer stay FP32 in the "
            f"typed file: {', '.join(shifts[:4])}{' ...' if len(shifts) > 4 else ''}"
        )
    del proto.metadata_props[:]
    for key, value in meta:
        proto.metadata_props.add(key=key, value=value)
    for node in proto.graph.node:  # each node's modules, as export stamped them
        if not node.metadata_props:
            for key, value in stamps.get(node.name, ()):
                node.metadata_props.add(key=key, value=value)
    floored = floor_act_scales(proto)
    if floored:
        notes.append(
            f"{len(floored)} activation scale(s) below 2^-25, 0 in FP16 (a tensor whose "
            "values stay below 3.8e-6), are stored as 2^-24, FP16's smallest step, which "
            f"that tensor's FP16 values are on anyway: {', '.join(floored[:4])}"
            + (" ..." if len(floored) > 4 else "")
        )
    refit = fit_weight_scales(proto)
    if refit:
        notes.append(
            f"{len(refit)} weight(s) hold scales below FP16's normal range (2^-14), each "
            "stored as an FP16 value, the codes fitted to it where that moves the weights "
            "less: every channel within half a code step (and 2^-25) of its FP32 weights, "
            f"INT8's own rounding, and no scale 0: {', '.join(refit[:4])}"
            + (" ..." if len(refit) > 4 else "")
        )
    origins = {n.name: o for n, o in zip(proto.graph.node, map_nodes(proto.graph, set(), []))}
    result = convert_fp16(proto, islands, origins, io_dtype)
    return result.model, notes + result.warnings


def beyond_fp16(proto) -> list[str]:
    """The nodes reading a float initializer with a value beyond FP16's largest (65504):
    a batch norm's variance, as PP-OCRv4's detector head holds up to 9.8e7."""
    wide = wide_initializers(proto)
    return [n.name for n in proto.graph.node if wide & set(n.input)]


def wide_initializers(proto) -> set[str]:
    """The float initializers holding a value beyond FP16's largest (65504)."""
    from onnx import numpy_helper

    from fp16lens._core import FP16_MAX

    wide = set()
    for init in proto.graph.initializer:
        if init.data_type == 1:
            values = numpy_helper.to_array(init)
            if values.size and float(np.abs(values).max()) > FP16_MAX:
                wide.add(init.name)
    return wide


def fp16_weight_codes(
    codes: np.ndarray, scale: np.ndarray, axis: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """A weight's INT8 ``codes`` and FP32 ``scale`` (per channel along ``axis``, or one) as
    the typed file stores them, its scale FP16. A scale FP16 holds to its own rounding
    (2^-11 of it) is kept, codes and all. Below FP16's normal range (2^-14) a scale loses
    more, up to all of it below 2^-25, where it is 0 and its channel's weights with it
    (EfficientNet-Lite0's and PP-OCRv4's dead channels, weights near 1e-6), and TensorRT
    takes only positive scales. There, per channel, the scale is the FP16 value nearest
    it, or the next FP16 value up (at least 2^-24) with the codes fitted to it (``rint(codes
    * s / s')``), whichever moves the dequantized weight less from ``codes * s`` (the
    second where the first is 0): either way by at most half its code step (``s / 2``,
    INT8's own rounding) and 2^-25 (half FP16's finest step), where the nearest FP16 scale
    alone moves a channel by up to all of its weights (docs/int8.md measures the zoo's).
    Returns (codes, scale), the scale FP32, on FP16's grid where it moved."""
    s = np.asarray(scale, np.float32)
    s16 = s.astype(np.float16).astype(np.float32)
    off = np.abs(s16 - s) > s * np.float32(2.0**-11)
    if not off.any():
        return codes, scale
    up = np.where(
        s16 < s, np.nextafter(s16.astype(np.float16), np.float16(np.inf)).astype(np.float32), s16
    )
    moved = np.maximum(up, FP16_TINIEST)

    channel = None if axis is None or not np.ndim(s) else axis % codes.ndim

    def along(v):
        if channel is None:
            return v
        return v.reshape([-1 if a == channel else 1 for a in range(codes.ndim)])

    q = codes.astype(np.float32)
    fitted = np.clip(np.rint(q * along(s / moved)), -127, 127)
    want = q * along(s)
    axes = None if channel is None else tuple(a for a in range(codes.ndim) if a != channel)
    err_kept = np.abs(q * along(s16) - want).max(axis=axes, initial=0.0)
    err_fitted = np.abs(fitted * along(moved) - want).max(axis=axes, initial=0.0)
    refit = off & ((err_fitted < err_kept) | (s16 == 0))
    if refit.any():
        codes = np.where(along(refit), fitted, q).astype(codes.dtype)
    stored = np.where(refit, moved, np.where(off, s16, s)).astype(np.float32)
    return codes, stored.reshape(np.shape(scale))


def fit_weight_scales(proto) -> list[str]:
    """Each weight's DequantizeLinear in ``proto`` (INT8 codes and an FP32 scale, both
    initializers) with its codes and scale as ``fp16_weight_codes`` stores them for an FP16
    scale, in place; the weights whose scale moved (on FP16's grid now, so the conversion
    to FP16 that follows loses nothing more of it)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    reads: dict[str, int] = {}
    for node in proto.graph.node:
        for name in node.input:
            reads[name] = reads.get(name, 0) + 1
    moved = []
    for node in proto.graph.node:
        if node.op_type != "DequantizeLinear" or len(node.input) < 2:
            continue
        if any(reads.get(t, 0) > 1 for t in node.input[:2]):  # a scale another DQ reads
            continue  # would move that one's weights: FP16's rounding of it, as it was
        q, s = (inits.get(t) for t in node.input[:2])
        if q is None or s is None or q.data_type != 3 or s.data_type != 1:  # INT8, FLOAT
            continue
        codes, scale = numpy_helper.to_array(q), numpy_helper.to_array(s)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        fitted, fp16_scale = fp16_weight_codes(codes, scale, axis if scale.ndim else None)
        if fp16_scale is scale:
            continue
        q.CopyFrom(numpy_helper.from_array(fitted, q.name))
        s.CopyFrom(numpy_helper.from_array(fp16_scale, s.name))
        moved.append(q.name)
    return moved


def floor_act_scales(proto) -> list[str]:
    """Each scale a QuantizeLinear of ``proto`` reads (an activation's, FP32 initializer)
    that FP16 makes 0 set to 2^-24, in place: QuantizeLinear would divide by 0, and
    TensorRT takes only positive scales. Nothing is lost that FP16 keeps: the tensor's
    values are below 127 * 2^-25, where FP16 holds them on steps of 2^-24 too. The scales
    set."""
    from onnx import numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    read = {n.input[1] for n in proto.graph.node if n.op_type == "QuantizeLinear"}
    floored = []
    for name in sorted(read & set(inits)):
        init = inits[name]
        if init.data_type != 1:  # FLOAT
            continue
        s = numpy_helper.to_array(init)
        stored = act_scale_floored(s)
        if not np.array_equal(stored, s):
            init.CopyFrom(numpy_helper.from_array(stored, name))
            floored.append(name)
    return floored


def act_scale_floored(scales: np.ndarray) -> np.ndarray:
    """Activation ``scales`` (FP32) with each that FP16 makes 0 set to 2^-24, the rest as
    given: what the typed file stores (``floor_act_scales``) and the search's FP16 twin is
    fed, rounded (``_int8_search.Switch.run``)."""
    s = np.asarray(scales, np.float32)
    return np.where((s > 0) & (s.astype(np.float16) == 0), FP16_TINIEST, s).astype(np.float32)
