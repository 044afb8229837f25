"""Constants beyond FP16 that no output depends on: checked in ONNX Runtime, per batch.

A float constant beyond 65504 becomes inf in FP16, which ``watch._params`` calls a
problem. Some exporters write constants that are never read for their value: Paddle2ONNX
hands a Loop uninitialized "undefined_var" state (1.77e27 in PP-Structure's SLANet-plus
table recognizer) that the first iteration overwrites. For each such constant of the
main graph (at most ``MAX_CHECKED``), the graph runs once more per batch with that
constant as FP16 makes it (±inf, NaN where FP16 cannot hold it at all), everything else
FP32; a constant with which every output of every batch stays bit for bit what it was
reaches no output, and ``settle`` makes its finding a note that says how it was measured."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fp16lens._core.optional import import_optional
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report import Report
from fp16lens.watch.onnx._graph import OnnxGraph
from fp16lens.watch.onnx._run import feed, ort_session

MAX_CHECKED = 8  # constants beyond FP16 checked this way; others stay problems


def _beyond(a: np.ndarray, threshold: float) -> bool:
    finite = np.isfinite(a)
    return bool(finite.any()) and float(np.abs(a[finite]).max()) > threshold


def _as_fp16(a: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return a.astype(np.float16).astype(a.dtype)


class DeadConstants:
    """Which main-graph constants beyond FP16 change an output when FP16 holds them."""

    def __init__(self, graph: OnnxGraph, threshold: float):
        self.graph = graph
        self.names = [n for n, a in graph.consts.items() if _beyond(a, threshold)][:MAX_CHECKED]
        self.changed: set[str] = set()
        self.batches = 0
        self._sessions: dict[str, Any] = {}

    def _session(self, name: str | None):
        key = name or ""
        if key not in self._sessions:
            proto = type(self.graph.proto)()
            proto.CopyFrom(self.graph.proto)
            if name is not None:
                _replace(proto, name, _as_fp16(self.graph.consts[name]))
            self._sessions[key] = ort_session(proto, self.graph.name)
        return self._sessions[key]

    def step(self, batch: Any) -> None:
        if not self.names:
            return
        inputs = feed(self.graph, batch)
        want = self._session(None).run(None, inputs)
        for name in self.names:
            if name in self.changed:
                continue
            got = self._session(name).run(None, inputs)
            if not all(_same(a, b) for a, b in zip(want, got)):
                self.changed.add(name)
        self.batches += 1

    def settle(self, report: Report) -> None:
        """Each overflow finding of a constant that changed no output: a note."""
        dead = set(self.names) - self.changed if self.batches else set()
        for i, f in enumerate(report.findings):
            if (
                f.mechanism == Mechanism.PARAMETER
                and f.kind == FindingKind.PARAM_OVERFLOW
                and f.tensor in dead
            ):
                report.findings[i] = dataclasses.replace(
                    f,
                    mechanism=Mechanism.NOTE,
                    detail=(
                        f"{f.detail}; harmless: run with it as FP16 holds it, every output "
                        f"of the {self.batches} batch(es) stays bit for bit the same, so its "
                        "value reaches no output (a Loop's initial state its first "
                        "iteration overwrites, say)"
                    ),
                    fix="none: its value reaches no output",
                )


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _replace(proto, name: str, value: np.ndarray) -> None:
    numpy_helper = import_optional("onnx", "onnx", "scanning an ONNX model").numpy_helper
    for init in proto.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(value, name))
            return
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for a in node.attribute:
                if a.name == "value":
                    a.t.CopyFrom(numpy_helper.from_array(value, a.t.name))
            return
