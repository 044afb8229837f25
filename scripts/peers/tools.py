"""The fixes compared: each takes a prepared Case and writes an FP16 ONNX file.

All start from the same FP32 ONNX graph (``fp16lens.export(model, ..., precision="fp32")``,
torch's dynamo exporter) except fp16lens, which exports its patched model. Peer imports
happen inside the functions so a missing or broken peer becomes that row's error.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

import fp16lens
from fp16lens.report import Report
from fp16lens.verify._onnx_sites import site_of_node


@dataclass
class Case:
    """One model prepared for every tool: its FP32 ONNX file and the sites to block."""

    name: str
    model: nn.Module | str  # an .onnx path: the case starts from an ONNX file (ONNX in)
    inputs: tuple
    report: Report
    fp32_path: Path
    workdir: Path
    notes: list[str] = field(default_factory=list)

    def problem_sites(self) -> set[str]:
        """Sites of the report's spans and of its non-note findings (what a user would block)."""
        sites = {s for span in self.report.spans for s in span.sites}
        sites |= {f.site for f in self.report.findings if f.mechanism != "note"}
        return sites

    def out(self, tool: str) -> Path:
        return self.workdir / f"{self.name}.{tool}.onnx"


@dataclass(frozen=True)
class Fix:
    """A written FP16 file and what the tool did (a short note for the table)."""

    path: Path
    note: str = ""


def fp16lens_fix(case: Case) -> Fix:
    if isinstance(case.model, str):
        return _fp16lens_onnx_fix(case)
    patched = fp16lens.patch(case.model, case.report)
    art = fp16lens.export(patched, case.inputs, case.out("fp16lens"), precision="fp16")
    plan = getattr(patched, "_fp16lens_plan", None)
    regions = len(plan.regions) if plan is not None else 0
    return Fix(art.path, f"{regions} rescaled region(s), {len(art.fp32_nodes)} FP32 node(s)")


def _fp16lens_onnx_fix(case: Case) -> Fix:
    """The ONNX-in journey: patch the graph itself, then re-type it to FP16."""
    fixed = case.workdir / f"{case.name}.fp16lens.fp32.onnx"
    fp16lens.patch(case.model, case.report, out=fixed)
    plan = fp16lens.plan(case.model, case.report)
    art = fp16lens.export(str(fixed), None, case.out("fp16lens"), precision="fp16")
    return Fix(
        art.path, f"{len(plan.regions)} rescaled region(s), {len(art.fp32_nodes)} FP32 node(s)"
    )


def all_fp16(case: Case) -> Fix:
    """No fix: onnxconverter-common with nothing blocked (every node FP16)."""
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per weight clamped to 1e-7
        proto = float16.convert_float_to_float16(onnx.load(str(case.fp32_path)), keep_io_types=True)
    return _save(proto, case.out("all_fp16"), "nothing blocked beyond its default op_block_list")


def blocked_span(case: Case) -> Fix:
    """onnxconverter-common with the problem sites' nodes in ``node_block_list``."""
    from onnxconverter_common import float16

    proto = onnx.load(str(case.fp32_path))
    sites = case.problem_sites()
    if isinstance(case.model, str):  # ONNX in: the report's sites are the node names
        block = [n.name for n in proto.graph.node if n.name in sites]
    else:
        block = [n.name for n in proto.graph.node if site_of_node(n, case.model) in sites]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = float16.convert_float_to_float16(proto, keep_io_types=True, node_block_list=block)
    return _save(proto, case.out("blocked"), f"{len(block)} node(s) blocked")


def autocast(case: Case, data_max: float) -> Fix:
    """ModelOpt AutoCast, calibrated on the case's inputs (nodes whose FP32 I/O exceeds
    ``data_max`` stay FP32)."""
    from modelopt.onnx.autocast import convert_to_mixed_precision

    names = [i.name for i in onnx.load(str(case.fp32_path), load_external_data=False).graph.input]
    npz = case.workdir / f"{case.name}.calib.npz"
    np.savez(npz, **{n: np.asarray(t) for n, t in zip(names, _tensors(case.inputs))})
    with _quiet():
        proto = convert_to_mixed_precision(
            str(case.fp32_path), data_max=data_max, keep_io_types=True, calibration_data=str(npz)
        )
    return _save(proto, case.out(f"autocast{data_max:g}"), f"data_max={data_max:g}")


def _tensors(inputs: tuple) -> list:
    return [
        t.detach() if torch.is_tensor(t) else t
        for t in inputs
        if torch.is_tensor(t) or isinstance(t, np.ndarray)
    ]


def _save(proto, path: Path, note: str) -> Fix:
    onnx.save(proto, str(path))
    return Fix(path, note)


@contextlib.contextmanager
def _quiet():
    """ModelOpt logs every skipped node at INFO and prints progress; keep the tables readable."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(("modelopt", "polygraphy"))]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


Tool = Callable[[Case], Fix]
