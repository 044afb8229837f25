"""scan() of an ONNX model: the graph in ONNX Runtime (FP32, CPU) batch by batch, reduced
into the same Report a PyTorch model gets (sites are nodes, edges the graph's dataflow)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fp16lens._core import WatchError
from fp16lens._core.fingerprint import onnx_fingerprint
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report import Finding, Report
from fp16lens.watch._accumulate import Accumulator
from fp16lens.watch._build import build_report
from fp16lens.watch._options import WatchOptions
from fp16lens.watch.onnx._checks import decomposed_norm
from fp16lens.watch.onnx._graph import analyse
from fp16lens.watch.onnx._params import check_constants
from fp16lens.watch.onnx._run import run_batch, session

_HOW = "pass a list of batches: scan('model.onnx', [x]), [(x1, x2)] or [{'input': x}]"


def is_onnx_model(model: Any) -> bool:
    """A path ending in .onnx, or an onnx.ModelProto."""
    if isinstance(model, (str, Path)):
        return str(model).lower().endswith(".onnx")
    return type(model).__name__ == "ModelProto" and hasattr(model, "graph")


def scan_onnx(model: Any, batches: Iterable[Any], *, progress: bool = True,
              description: str = "watching", base_dir: str | Path | None = None,
              **watch_options: Any) -> Report:
    """Run the ONNX ``model`` (a path or a ModelProto; ``base_dir``: the folder of a
    proto's external data) on every batch and return the report."""
    from rich.console import Console
    from rich.progress import Progress

    options = WatchOptions(**watch_options)
    _check_batches(batches)
    graph = analyse(model, base_dir)
    sess = session(graph)
    acc = Accumulator(options.threshold, graph.sites)
    total = len(batches) if hasattr(batches, "__len__") else None
    bar = Progress(console=Console(stderr=True), transient=True, disable=not progress)
    with bar:
        task = bar.add_task(description, total=total)
        for i, batch in enumerate(batches):
            acc.add(run_batch(graph, sess, batch, i, options.threshold, options.sample_size))
            bar.advance(task)
    if not acc.batches:
        raise WatchError(f"scan() got no batch (the iterable was empty); {_HOW}")
    params = check_constants(graph, options) if options.params else []
    report = build_report(acc, graph.sites, params, None, options.threshold,
                          source=(graph.name, onnx_fingerprint(graph.proto)))
    _note_hidden_subgraphs(report, graph.proto)
    return _name_decomposed_norms(report, graph)


def _note_hidden_subgraphs(report: Report, proto) -> None:
    """A note naming the control-flow nodes (If/Loop/Scan) whose bodies the scan cannot see:
    ONNX Runtime exposes no tensor computed inside a subgraph, so a clean verdict there says
    nothing about the values inside."""
    from onnx import AttributeProto

    hidden = [n for n in proto.graph.node
              if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in n.attribute)]
    if not hidden:
        return
    names = ", ".join(f"{n.name or n.output[0]} ({n.op_type})" for n in hidden[:3])
    more = f" and {len(hidden) - 3} more" if len(hidden) > 3 else ""
    report.findings.append(Finding(
        site="", mechanism=Mechanism.NOTE, kind=FindingKind.UNSCANNED, peak=0.0,
        detail=f"{len(hidden)} control-flow node(s) hold subgraphs whose tensors ONNX Runtime does "
               f"not expose: {names}{more}; values computed inside them were not scanned",
    ))


def _check_batches(batches: Any) -> None:
    if hasattr(batches, "shape") and hasattr(batches, "dtype"):
        raise WatchError(f"scan() got a bare array {tuple(batches.shape)}, which it would iterate "
                         f"over its first axis; {_HOW}")
    if isinstance(batches, dict) or not isinstance(batches, Iterable):
        raise WatchError(f"scan() needs an iterable of batches, got {type(batches).__name__}; {_HOW}")


def _name_decomposed_norms(report: Report, graph) -> Report:
    """A span starting at the Pow of a decomposed norm says so."""
    ids = {s.name: i for i, s in enumerate(graph.sites)}
    for i, f in enumerate(report.findings):
        sid = ids.get(f.site)
        if f.mechanism == Mechanism.OUTPUT and sid is not None and decomposed_norm(graph, sid):
            report.findings[i] = dataclasses.replace(f, detail=(
                "(x-mean)^2 of a decomposed norm (ReduceMean, Sub, Pow, ReduceMean: a "
                "LayerNorm/GroupNorm exported below opset 17/18) is stored in FP16; "
                f"{f.detail}; export at opset 17+ so it stays one LayerNormalization node"))
    return report
