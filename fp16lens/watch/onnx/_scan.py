"""scan() of an ONNX model: the graph in ONNX Runtime (FP32, CPU) batch by batch, reduced
into the same Report a PyTorch model gets (sites are nodes, edges the graph's dataflow)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fp16lens._core.fingerprint import onnx_fingerprint
from fp16lens._core.onnx_types import has_subgraph
from fp16lens._core.options import one_form
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report import Finding, Report
from fp16lens.watch._accumulate import Accumulator
from fp16lens.watch._advise import advised
from fp16lens.watch._build import build_report
from fp16lens.watch._loop import HOW_ONNX, scan_with
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._params import ParamCheck
from fp16lens.watch.onnx._checks import decomposed_norm
from fp16lens.watch.onnx._dead import DeadConstants
from fp16lens.watch.onnx._fp16run import Fp16Run
from fp16lens.watch.onnx._graph import analyse
from fp16lens.watch.onnx._inline import node_site
from fp16lens.watch.onnx._params import check_constants, guard_constants
from fp16lens.watch.onnx._underflow import UnderflowScan
from fp16lens.watch.onnx._variants import Graphs


def scan_onnx(
    model: Any,
    batches: Iterable[Any],
    *,
    progress: bool = True,
    description: str = "watching",
    base_dir: str | Path | None = None,
    options: WatchOptions | None = None,
    **watch_options: Any,
) -> Report:
    """Run the ONNX ``model`` (a path or a ModelProto; ``base_dir``: the folder of a
    proto's external data) on every batch and return the report."""
    options = one_form(WatchOptions, options, watch_options)
    return scan_with(
        lambda: OnnxScan(model, base_dir, options),
        batches,
        progress=progress,
        description=description,
        how=HOW_ONNX,
    )[1]


class OnnxScan:
    """The ONNX front end (a ``FrontEnd`` of the scan loop): the graph, and each If branch
    the batches take inlined into a variant of it, run in ONNX Runtime batch by batch."""

    def __init__(self, model: Any, base_dir: str | Path | None, options: WatchOptions):
        self.graph = analyse(model, base_dir)
        self.graphs = Graphs(self.graph)
        self.options = options
        self.acc = Accumulator(options.threshold, self.graphs.sites)
        self.under = UnderflowScan()
        self.dead = DeadConstants(self.graph, options.threshold) if options.params else None
        self.fp16 = Fp16Run(self.graph)

    def session(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def step(self, index: int, batch: Any) -> None:
        opts = self.options
        self.acc.add(
            self.graphs.run(batch, index, opts.threshold, opts.sample_size, self.under.observe)
        )
        if self.dead is not None:
            self.dead.step(batch)
        self.fp16.step(batch)

    def report(self, complete: bool) -> Report | None:
        acc, graphs, options = self.acc, self.graphs, self.options
        if not acc.batches:
            return None
        source = (self.graph.name, onnx_fingerprint(self.graph.proto))
        if not complete:  # after Ctrl-C: the statistics of what ran
            return build_report(acc, graphs.sites, [], None, options.threshold, source=source)
        params = _params(graphs, options) if options.params else []
        report = build_report(acc, graphs.sites, params, None, options.threshold, source=source)
        report.findings.extend(self.under.findings())
        if self.dead is not None:
            self.dead.settle(report)
        guard_constants(report, self.under.guards())
        _note_inlined(report, graphs)
        _note_fp16_file(report, self.graph.fp16_source)
        if self.graph.fp16_source:
            _note_clamped(report, self.graph)
        _note_hidden_subgraphs(report, [v.graph.proto for v in graphs.variants.values()])
        self.fp16.settle(report)
        report = _name_decomposed_norms(report, graphs)
        self._release()
        return advised(self.graph.proto, report, options.advise)  # data loaded

    def _release(self) -> None:
        """Before the advice, which reads the proto and plans on a copy of its own: drop
        the ONNX Runtime sessions and the float constants the scan held (each about the
        weights' size again on a large model). The report is settled: nothing runs after."""
        for v in self.graphs.variants.values():
            v.session = None
            v.graph.consts.clear()
        self.graphs.release()
        if self.dead is not None:
            self.dead.release()


def _params(graphs: Graphs, options: WatchOptions) -> list:
    """The constants of every graph scanned, each tensor once."""
    out: dict[tuple[str, str], ParamCheck] = {}  # (tensor, kind) -> its first check
    for v in graphs.variants.values():
        g = v.graph
        for c in check_constants(g, options):
            readers = g.consumers.get(c.finding.tensor, [])
            if g.fp32 and readers and all(g.sites[s].name in g.fp32 for s in readers):
                continue  # read only by FP32 islands: an FP16 file keeps it FP32
            out.setdefault((c.finding.tensor, c.finding.kind), c)
    return list(out.values())


def _note_fp16_file(report: Report, share: float) -> None:
    """A note saying the file already computes in float16 and was scanned as its FP32 twin
    (``_core/onnx_upcast.py``)."""
    if not share:
        return
    _note(
        report,
        FindingKind.FP16_FILE,
        f"the file already computes in float16 ({share:.0%} of its computing nodes write "
        "float16): read as it is, its values would be FP16's own, inf where FP16 overflowed; it "
        "was scanned as its FP32 twin (every float16 tensor and type as float32, the same "
        "nodes), so the values are how far FP32 goes, and the verdict is checked in FP16 "
        "storage, what the file computes",
    )


def _note(report: Report, kind: str, detail: str) -> None:
    """A note of the whole graph (no site) on ``report``."""
    report.findings.append(
        Finding(site="", mechanism=Mechanism.NOTE, kind=kind, peak=0.0, detail=detail)
    )


CONVERTER_BOUND = 1.0e4
"""onnxconverter-common's ``convert_float_to_float16`` clamps every constant beyond ±1e4
(its ``max_finite_val``) to ±1e4, though FP16 holds up to 65504."""


def _note_clamped(report: Report, graph) -> None:
    """A note per constant of an FP16 file (more than one value) that holds exactly ±1e4:
    where its FP32 file held more, the conversion changed the model (PP-OCRv4's detector:
    a batch-norm variance of 9.8e7 became 1e4, and the text mask moved to IoU 0.67)."""
    import numpy as np

    for name, value in graph.consts.items():
        hits = int(np.count_nonzero(np.abs(value) == CONVERTER_BOUND))
        if value.size < 2 or not hits:
            continue
        readers = sorted({graph.sites[s].name for s in graph.consumers.get(name, [])})
        where = ", ".join(readers[:3]) + (" ..." if len(readers) > 3 else "")
        report.findings.append(
            Finding(
                site=readers[0] if readers else name,
                mechanism=Mechanism.NOTE,
                kind=FindingKind.CONVERTER_CLAMP,
                peak=CONVERTER_BOUND,
                count=hits,
                tensor=name,
                detail=f"{name} (read by {where or 'no node'}): {hits} of its {value.size} "
                "values are exactly ±10000, the bound onnxconverter-common's "
                "convert_float_to_float16 clamps larger values to (max_finite_val); if the FP32 "
                "file held more there (a batch norm's variance, a large scale), the conversion "
                "changed the model, which this file alone cannot show",
            )
        )


def _note_inlined(report: Report, graphs: Graphs) -> None:
    """A note naming the If branches the scan saw by inlining them, and on how many batches."""
    taken: dict[tuple[str, str], int] = {}
    for key, v in graphs.variants.items():
        for pair in v.taken:
            taken[pair] = taken.get(pair, 0) + graphs.batches[key]
    if not taken:
        return
    names = ", ".join(
        f"{s} ({b}, {n} batch{'es' if n > 1 else ''})" for (s, b), n in list(taken.items())[:3]
    )
    more = f" and {len(taken) - 3} more" if len(taken) > 3 else ""
    _note(
        report,
        FindingKind.INLINED,
        f"{len(taken)} If branch(es) taken by the batches were scanned inlined in the main "
        f"graph, their sites named '<If>/<branch>/<node>': {names}{more}; patch rewrites the "
        "main graph only, and fp16lens.export keeps If nodes FP32",
    )


def _note_hidden_subgraphs(report: Report, protos: list) -> None:
    """A note naming the control-flow nodes (If/Loop/Scan) whose bodies the scan cannot see:
    ONNX Runtime exposes no tensor computed inside a subgraph, so a clean verdict there says
    nothing about the values inside."""
    hidden = list(
        {node_site(n): n for p in protos for n in p.graph.node if has_subgraph(n)}.values()
    )
    if not hidden:
        return
    names = ", ".join(f"{n.name or n.output[0]} ({n.op_type})" for n in hidden[:3])
    more = f" and {len(hidden) - 3} more" if len(hidden) > 3 else ""
    _note(
        report,
        FindingKind.UNSCANNED,
        f"{len(hidden)} control-flow node(s) hold subgraphs whose tensors ONNX Runtime does not "
        f"expose: {names}{more}; values computed inside them were not scanned",
    )


def _name_decomposed_norms(report: Report, graphs: Graphs) -> Report:
    """A span starting at the Pow of a decomposed norm says so."""
    for i, f in enumerate(report.findings):
        where = graphs.of_site(f.site) if f.mechanism == Mechanism.OUTPUT else None
        if where is not None and decomposed_norm(*where):
            report.findings[i] = dataclasses.replace(
                f,
                detail=(
                    "(x-mean)^2 of a decomposed norm (ReduceMean, Sub, Pow, ReduceMean: a "
                    "LayerNorm/GroupNorm exported below opset 17/18) is stored in FP16; "
                    f"{f.detail}; export at opset 17+ so it stays one LayerNormalization node"
                ),
            )
    return report
