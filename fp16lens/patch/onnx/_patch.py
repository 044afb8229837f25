"""patch() of an ONNX graph: the PyTorch planner over an ``OnnxBinding``, the plan applied
to a copy of the graph, then checked: ``onnx.checker`` (full check) and the FP32 outputs of
the original and the patched graph in ONNX Runtime (within ``TOLERANCE``). On failure a
PatchError and nothing is returned or written."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp16lens._core import PatchError, StaleReportError, import_optional
from fp16lens._core.feeds import feed_items
from fp16lens._core.fingerprint import onnx_changed
from fp16lens.patch._check import TOLERANCE as AFFINE_TOLERANCE
from fp16lens.patch._check import relative_error
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._plan import Plan
from fp16lens.patch._planner import build_plan
from fp16lens.patch.onnx._apply import apply
from fp16lens.patch.onnx._binding import OnnxBinding
from fp16lens.patch.onnx._branches import fold_branches
from fp16lens.patch.onnx._graph import (
    FLOAT_TYPES,
    FP32_NODES_KEY,
    OnnxModel,
    load,
    onnx_module,
    read,
)
from fp16lens.patch.onnx._underflow import underflow_islands
from fp16lens.report import Report

TOLERANCE = 1e-6
"""Relative to each output's largest |value|: rescaling by powers of two is exact. It is
checked against the original with its batch norms in affine form (when the plan has any):
that form rounds once in FP32, which layers after it can amplify beyond 1e-6 (1e-4 at most,
``patch/_check.py``'s tolerance, is what the affine form alone is held to)."""


def fp32_nodes(proto) -> list[str]:
    """The node names an FP16 export of ``proto`` keeps in FP32 (``metadata_props``)."""
    for p in proto.metadata_props:
        if p.key == FP32_NODES_KEY:
            return list(json.loads(p.value))
    return []


def plan_onnx(model: Any, report: Report, options: PatchOptions) -> Plan:
    """What patch_onnx() would do; nothing is changed."""
    return _plan(read(load(model)), report, options)[0]


def patch_onnx(model: Any, report: Report, options: PatchOptions, out: str | Path | None = None,
               batches: list | None = None) -> tuple[Any, Plan]:
    """The patched graph (a new ModelProto) and its plan; written to ``out`` when given.
    The FP32 check runs on ``batches`` (else on seeded random inputs of the report's shapes)."""
    onnx = onnx_module()
    original = load(model)
    m = read(load(original))
    the_plan, binding = _plan(m, report, options)
    if not the_plan.changes:  # a clean graph stays as it was
        if out is not None:
            onnx.save(original, str(out))
        return original, the_plan
    fp32 = apply(m, the_plan, binding.units)
    if fp32:
        _set_fp32_nodes(m.proto, [*fp32_nodes(original), *fp32])
    try:
        onnx.checker.check_model(m.proto, full_check=True)
    except Exception as exc:
        raise PatchError(
            f"the patched graph fails onnx.checker ({str(exc).splitlines()[0][:300]}); the "
            "model was left untouched: please report it with the model's op types"
        ) from exc
    if options.check:
        the_plan.notes.extend(_checks(original, m.proto, the_plan, binding, report, batches))
    if out is not None:
        onnx.save(m.proto, str(out))
    return m.proto, the_plan


def _plan(m: OnnxModel, report: Report, options: PatchOptions):
    _require(m, report)
    report = fold_branches(m, report)
    binding = OnnxBinding(m, set(fp32_nodes(m.proto)))
    the_plan = build_plan(None, report, options, binding)
    taken = {i.module for i in the_plan.islands} | set(fp32_nodes(m.proto))
    the_plan.islands.extend(underflow_islands(m, report, taken))
    return the_plan, binding


def _set_fp32_nodes(proto, names: list[str]) -> None:
    for i, p in enumerate(proto.metadata_props):
        if p.key == FP32_NODES_KEY:
            del proto.metadata_props[i]
            break
    entry = proto.metadata_props.add()
    entry.key, entry.value = FP32_NODES_KEY, json.dumps(list(dict.fromkeys(names)))


def _require(m: OnnxModel, report: Report) -> None:
    if not isinstance(report, Report):
        raise PatchError(
            f"patch needs a fp16lens Report, got {type(report).__name__}; create one with "
            "fp16lens.scan('model.onnx', batches) or load one with fp16lens.Report.load(path)"
        )
    stale = onnx_changed(report.meta.weights, m.proto)
    if stale:
        raise StaleReportError(
            f"the report was made from other initializers than this graph's ({', '.join(stale[:3])} "
            "changed since it was scanned), so its ranges do not apply: scan this model again "
            "(fp16lens.scan or `fp16lens scan`) and patch with the new report"
        )


def _inputs(m_proto, report: Report) -> list[dict[str, np.ndarray]]:
    onnx = onnx_module()
    inits = {i.name for i in m_proto.graph.initializer}
    graph_inputs = [i for i in m_proto.graph.input if i.name not in inits]
    shapes = report.meta.input_shapes[0] if report.meta.input_shapes else None
    if shapes is None or len(shapes) != len(graph_inputs):
        return []
    rng = np.random.default_rng(0)
    feed = {}
    for vi, shape in zip(graph_inputs, shapes):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feed[vi.name] = rng.random(shape).astype(dtype) if vi.type.tensor_type.elem_type in FLOAT_TYPES \
            else np.zeros(shape, dtype=dtype)
    return [feed]


def _feeds(proto, batches) -> list[dict[str, np.ndarray]]:
    inits = {i.name for i in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    out = []
    for batch in batches:
        items = feed_items(batch, names, PatchError, "the ONNX model")
        out.append({n: np.asarray(a.numpy() if torch.is_tensor(a) else a) for n, a in items})
    return out


def _session(proto):
    ort = import_optional("onnxruntime", "onnx", "checking a patched ONNX model")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _checks(original, patched, the_plan: Plan, binding, report: Report, batches) -> list[str]:
    feeds = _feeds(original, batches) if batches is not None else _inputs(original, report)
    if not feeds:
        return ["FP32 equivalence not checked: the report holds no input shapes for the graph's inputs"]
    affine = [r for r in the_plan.reparametrized if r.rule == "bn-affine"]
    if affine:  # the affine forms alone, then the rescaling exact against them
        m = read(load(original))
        apply(m, Plan(reparametrized=[dataclasses.replace(r, s_in=1.0, s_out=1.0) for r in affine]),
              binding.units)
        _check(original, m.proto, feeds, AFFINE_TOLERANCE)
        original = m.proto
    _check(original, patched, feeds, TOLERANCE)
    return []


def _check(original, patched, feeds, tolerance: float) -> None:
    a, b = _session(original), _session(patched)
    for feed in feeds:
        for i, (x, y) in enumerate(zip(a.run(None, feed), b.run(None, feed))):
            if not np.issubdtype(np.asarray(x).dtype, np.floating):
                continue
            err = relative_error(torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y)))
            if not err <= tolerance:
                raise PatchError(
                    f"the patched graph's FP32 output {i} differs from the original's (relative "
                    f"error {err:.3g} > {tolerance:g}): a rescaled tensor reaches it by a path the "
                    "report's dataflow does not show; nothing was written. Keep the affected "
                    "nodes in FP32 instead"
                )
