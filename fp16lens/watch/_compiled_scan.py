"""scan(model, batches, compile=True): a long scan at compiled speed, eager as reference.

Per input signature (structure, shapes, dtypes of a batch): the first batch of the whole
scan runs on the eager path (it also learns the dtypes a ``.half()`` model computes in);
the first batch of each signature after that is captured into a graph (see _compiled)
and its own statistics are kept; the next one compiles that graph with Inductor, and
every later batch of the signature runs compiled. The events of all three kinds of
batches go to the one accumulator of the eager path, so the report is built as watch()
builds it.

Where capture or compile fails, that signature's batches run eagerly and the report
carries a note (a ``note`` finding) saying why.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fp16lens._core.options import one_form
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report import Finding, Report
from fp16lens.watch._accumulate import Accumulator
from fp16lens.watch._compiled import (
    Captured,
    StaticRecorder,
    capture,
    compile_graph,
    first_line,
    run_compiled,
    signature,
)
from fp16lens.watch._fp16run import TorchFp16Run
from fp16lens.watch._loop import call_batch, scan_with
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._session import ACTIVE, check_model, finished_report, parameters

FALLBACK = "compile=True fell back to the eager path"  # how a fallback note begins


@dataclass
class Timings:
    """Where a compiled scan's time went (seconds), for the benchmark."""

    capture: float = 0.0
    compile: float = 0.0  # the first compiled call: Inductor's compile and one run
    eager_batches: int = 0
    traced_batches: int = 0
    compiled_batches: int = 0
    fallbacks: list[str] = field(default_factory=list)


class CompiledScan:
    """The compiled front end (a ``FrontEnd`` of the scan loop): the state of one compiled
    scan, ``step(index, batch)`` per batch, ``report(complete)`` at the end."""

    def __init__(self, model: torch.nn.Module, options: WatchOptions, backend: str = "inductor"):
        check_model(model)
        self.model = model
        self.options = options
        self.params = parameters(model, options)
        self.rec = StaticRecorder(model, options, on_forward_end=self._add)
        self.acc = Accumulator(options.threshold, self.rec.sites)
        self.backend = backend
        self.graphs: dict[tuple, Captured] = {}
        self.timings = Timings()
        self.fp16 = TorchFp16Run(model)  # the clean verdict checked in real FP16

    def _add(self, fw) -> None:
        self.acc.add(fw)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        ACTIVE.add(self.model)
        try:
            with torch.no_grad():
                yield
        finally:
            ACTIVE.discard(self.model)

    def step(self, index: int, batch: Any) -> None:
        from fp16lens._trace import call_model

        self.fp16.step(batch)
        if self.rec.forwards == 0:
            return self._eager(batch)
        key = signature(batch)
        cap = self.graphs.get(key)
        if cap is None:
            t0, forwards = time.perf_counter(), self.rec.forwards
            cap, fw = capture(self.rec, self.model, batch, call_model)
            self.timings.capture += time.perf_counter() - t0
            self.graphs[key] = cap
            if fw is None:  # undo what the capture began, then the batch runs eagerly
                self._fell_back(cap.why)
                self.rec.forward, self.rec.forwards = None, forwards
                return self._eager(batch)
            self.timings.traced_batches += 1
            return self.acc.add(fw)
        if cap.why:
            return self._eager(batch)
        self._compiled(cap, batch)

    def _compiled(self, cap: Captured, batch: Any) -> None:
        first = cap.run is None
        t0 = time.perf_counter()
        try:
            if first:
                cap.run = compile_graph(cap, _device_of(batch, self.model), self.backend)
            fw = run_compiled(cap, batch, self.rec.forwards)
        except Exception as exc:
            if not first:
                raise
            cap.why = f"torch.compile could not compile the captured graph ({type(exc).__name__}: {first_line(exc)})"
            cap.run = cap.graph = None
            fw = None
        if fw is None:  # outside the except block: the recorder reads a raised exception
            # there as the forward raising (sys.exc_info)
            self._fell_back(cap.why)
            return self._eager(batch)
        if first:
            self.timings.compile += time.perf_counter() - t0
        self.rec.forwards += 1
        self.timings.compiled_batches += 1
        self.acc.add(fw)

    def _eager(self, batch: Any) -> None:
        self.timings.eager_batches += 1
        try:
            with self.rec.tracker, self.rec:
                call_batch(self.model, batch)
        except BaseException:
            self.rec.abort_forward()
            raise

    def _fell_back(self, why: str) -> None:
        if why not in self.timings.fallbacks:
            self.timings.fallbacks.append(why)

    def report(self, complete: bool = True) -> Report:
        notes = [
            Finding(
                site="",
                mechanism=Mechanism.NOTE,
                kind=FindingKind.COMPILE_FALLBACK,
                peak=0.0,
                detail=f"{FALLBACK}: {why}; those batches were watched eagerly (the reference path)",
            )
            for why in self.timings.fallbacks
        ]
        report = finished_report(
            self.acc, self.rec.sites, self.params, self.model, self.options, notes
        )
        if complete:
            self.fp16.settle(report)
        return report


def _device_of(batch: Any, model: torch.nn.Module) -> torch.device:
    from fp16lens.watch._compiled import tensors_of

    for t in tensors_of(batch):
        if t.is_floating_point() or t.device.type != "cpu":
            return t.device
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def scan_compiled(
    model: torch.nn.Module,
    batches,
    *,
    progress: bool = True,
    description: str = "watching",
    options: WatchOptions | None = None,
    backend: str = "inductor",
    **option_values: Any,
) -> tuple[Report, Timings]:
    """The body of ``scan(..., compile=True)``; returns the report and where the time went.
    ``backend``: torch.compile's backend, or "fx" for the captured graph run as it is."""
    options = one_form(WatchOptions, options, option_values)
    run, report = scan_with(
        lambda: CompiledScan(model, options, backend),
        batches,
        progress=progress,
        description=description,
    )
    assert isinstance(run, CompiledScan)
    return report, run.timings
