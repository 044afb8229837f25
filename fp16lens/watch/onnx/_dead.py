"""Constants beyond FP16 whose FP16 value (inf) changes no output: checked in ONNX
Runtime, per batch.

A float constant beyond 65504 becomes inf in FP16, which ``watch._params`` calls a
problem. Some exporters write constants that are never read for their value: Paddle2ONNX
hands a Loop uninitialized "undefined_var" state (1.77e27 in PP-Structure's SLANet-plus
table recognizer) that the first iteration overwrites. For the main graph's constants
beyond FP16 (at most ``MAX_CHECKED``), the graph runs once more per batch with them as
FP16 makes them (±inf), everything else FP32: all at once first, one by one only where
that changes an output. A constant with which every output of every batch stays bit for
bit what it was is harmless, and ``settle`` makes its finding a note that says how it
was measured."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fp16lens._core import onnx_large
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
        self._sessions: dict[tuple[str, ...], Any] = {}

    def _session(self, names: tuple[str, ...]):
        if names not in self._sessions:  # the graph itself, or a copy with those as FP16
            proto = self.graph.proto
            if names:
                proto = onnx_large.replacing(proto, lambda t: self._fp16_init(t, names))
                for name in names:
                    _replace_constant(proto, name, _as_fp16(self.graph.consts[name]))
            self._sessions[names] = ort_session(proto, self.graph.name)
        return self._sessions[names]

    def _fp16_init(self, init, names: tuple[str, ...]):
        """The initializer ``init`` as FP16 holds it where ``names`` has it, else None."""
        if init.name not in names:
            return None
        numpy_helper = import_optional("onnx", "onnx", "scanning an ONNX model").numpy_helper
        return numpy_helper.from_array(_as_fp16(self.graph.consts[init.name]), init.name)

    def release(self) -> None:
        """Drop the sessions (the scan is done)."""
        self._sessions.clear()

    def step(self, batch: Any) -> None:
        """One more run with every open constant as FP16 holds it; only where that changes
        an output, one run per constant to find which (a changed one is not run again)."""
        open_ = tuple(n for n in self.names if n not in self.changed)
        self.batches += 1
        if not open_:
            return
        inputs = feed(self.graph, batch)
        want = self._session(()).run(None, inputs)
        if self._same_outputs(want, open_, inputs):
            return
        if len(open_) == 1:
            self.changed.add(open_[0])
            return
        for name in open_:
            if not self._same_outputs(want, (name,), inputs):
                self.changed.add(name)

    def _same_outputs(self, want: list, names: tuple[str, ...], inputs: dict) -> bool:
        got = self._session(names).run(None, inputs)
        return all(_same(a, b) for a, b in zip(want, got))

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
                        f"of the {self.batches} batch(es) stays bit for bit the same (a "
                        "Loop's initial state its first iteration overwrites; a bound that "
                        "inf serves as well)"
                    ),
                    fix="none: FP16's value of it gives the same outputs",
                )


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _replace_constant(proto, name: str, value: np.ndarray) -> None:
    """The Constant node writing ``name`` (if any) given ``value``."""
    numpy_helper = import_optional("onnx", "onnx", "scanning an ONNX model").numpy_helper
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for a in node.attribute:
                if a.name == "value":
                    a.t.CopyFrom(numpy_helper.from_array(value, a.t.name))
            return
