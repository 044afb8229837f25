"""One batch through ONNX Runtime (CPU, graph optimizations off so every node and name
survives) with every float intermediate returned, reduced into a ``Forward`` at once:
only one batch of intermediates is ever held."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fp16lens._core import WatchError, import_optional, onnx_large
from fp16lens._core.feeds import as_input, feed_items
from fp16lens.report import SATURATED
from fp16lens.watch._inputs import describe_inputs
from fp16lens.watch._recorder import INPUT_SITE, Forward
from fp16lens.watch._tensorstats import take_sample
from fp16lens.watch.onnx._checks import internal_checks
from fp16lens.watch.onnx._graph import OnnxGraph


def session(graph: OnnxGraph):
    """A session returning every event tensor of ``graph``."""
    with graph.exposing() as proto:
        return ort_session(proto, graph.name)


def ort_session(proto, name: str):
    ort = import_optional("onnxruntime", "onnx", "scanning an ONNX model")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        return onnx_large.session(ort, proto, options)
    except Exception as exc:  # opset/IR versions this ONNX Runtime lacks, unknown ops
        raise WatchError(
            f"ONNX Runtime cannot load {name} ({str(exc).splitlines()[0]}); upgrade "
            "onnxruntime, or re-export the model at an opset it supports"
        ) from exc


def feed(graph: OnnxGraph, batch: Any) -> dict[str, np.ndarray]:
    """A batch (an array, a tuple of arrays in graph-input order, or a dict by input name)
    as ONNX Runtime's feed; float arrays are cast to the graph input's float type."""
    items = feed_items(batch, graph.inputs, WatchError, graph.name)
    return {n: as_input(a, graph.elem.get(n)) for n, a in items}


def run_batch(
    graph: OnnxGraph,
    sess,
    batch: Any,
    index: int,
    threshold: float,
    sample_size: int,
    observe: Callable | None = None,
) -> Forward | None:
    """The batch's ``Forward``; None when the batch meets other If conditions than the
    inlined ``graph`` assumes (``graph.checks``). ``observe(graph, values, index)`` sees
    every tensor of the batch by name before they are dropped."""
    values = feed(graph, batch)
    names = [t for _, t in graph.events]
    order = [o.name for o in sess.get_outputs()]
    try:
        got = dict(zip(order, sess.run(order, values)))
    except Exception as exc:  # onnxruntime's Fail/InvalidArgument: shapes, dtypes
        shapes = ", ".join(f"{n} {tuple(v.shape)} {v.dtype}" for n, v in values.items())
        raise WatchError(
            f"ONNX Runtime failed on batch {index} ({shapes}): {str(exc).splitlines()[0][:300]}; "
            "give inputs of the shapes and dtypes the model was exported for"
        ) from exc
    if not assumed(graph.checks, {**values, **got}):
        return None
    fw = Forward(index=index)
    fw.input_specs = describe_inputs((), {n: values[n] for n in graph.inputs})
    event_of: dict[str, int] = {}
    for n in graph.inputs:
        v = values[n]
        fw.input_shapes.append(list(v.shape))
        if v.dtype.kind == "f":
            fw.input_names.append(n)
            event_of[n] = _event(fw, INPUT_SITE, v, (), threshold, sample_size)
    for sid, t in graph.events:
        node = graph.nodes[sid]
        producers = tuple(event_of[i] for i in node.input if i in event_of)
        event_of[t] = _event(fw, sid, got[t], producers, threshold, sample_size)
        if graph.fp32 and graph.sites[sid].name in graph.fp32:
            fw.fp32.add(event_of[t])  # an FP32 island of the FP16 graph: not judged
    fw.outputs = tuple(event_of[o] for o in graph.outputs if o in event_of)
    maxes = {t: _absmax(fw.extremes[e]) for t, e in event_of.items()}
    fw.internal = internal_checks(graph, {**values, **got}, maxes, threshold)
    if observe is not None:
        observe(graph, {**values, **got}, index)
    del got, names
    return fw


def assumed(checks: list[tuple[str, bool]], values: dict) -> bool:
    return all(bool(np.asarray(values[t]).reshape(-1)[0]) == v for t, v in checks)


def _absmax(lo_hi: tuple[float, float]) -> float:
    lo, hi = lo_hi
    return hi if hi >= -lo else -lo


def _event(
    fw: Forward,
    sid: int,
    v: np.ndarray,
    producers: tuple[int, ...],
    threshold: float,
    sample_size: int,
) -> int:
    e = len(fw.sites)
    flat = np.ascontiguousarray(v, dtype=np.float32).reshape(-1)
    fw.sites.append(sid)
    fw.inputs.append(producers)
    fw.numels.append(flat.size)
    fw.shapes.append(list(v.shape))
    if flat.size == 0:
        fw.extremes.append((0.0, 0.0))
        fw.samples.append(torch.zeros(0))
        return e
    lo, hi = float(flat.min()), float(flat.max())
    fw.extremes.append((lo, hi))
    fw.samples.append(take_sample(torch.from_numpy(flat), sample_size))
    if not (max(-lo, hi) <= threshold):  # exact counts, as the recorder takes on the CPU
        a = np.abs(flat)
        nan = np.isnan(a)
        if nan.any():
            fw.finite_max[e] = float(np.where(np.isfinite(a), a, 0).max())
        huge = a >= SATURATED
        if huge.any():
            rest = np.where(huge | nan, 0, a)
            fw.saturated[e] = (float(rest.max()), int(huge.sum()))
            a = np.where(huge, 0, a)
        fw.exact_over[e] = int(np.count_nonzero(a > threshold)) + int(nan.sum())
    return e
