"""watch(): the context manager that records a model's FP16 range over forward calls."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

from fp16lens._core import WatchError
from fp16lens._core.options import one_form
from fp16lens.report import Report
from fp16lens.watch._accumulate import Accumulator
from fp16lens.watch._build import build_report
from fp16lens.watch._fp16run import TorchFp16Run
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._recorder import Recorder
from fp16lens.watch._session import ACTIVE, check_model, finished_report, parameters


class Lens:
    """The handle ``with fp16lens.watch(model) as lens`` gives; ``lens.report`` afterwards."""

    def __init__(self, model: torch.nn.Module, options: WatchOptions):
        check_model(model)
        self.model = model
        self.options = options
        self._recorder: Recorder | None = None
        self._acc: Accumulator | None = None
        self._params: list = []
        self._report: Report | None = None
        self._entered = contextlib.ExitStack()
        self._fp16: TorchFp16Run | None = None  # the clean verdict's check: made on entry

    def __enter__(self) -> Lens:
        check_model(self.model)
        self._params = parameters(self.model, self.options)
        rec = Recorder(self.model, self.options, on_forward_end=self._on_forward_end)
        self._acc = Accumulator(self.options.threshold, rec.sites, half_dtypes=rec.half_dtypes_of)
        self._recorder = rec
        ACTIVE.add(self.model)
        self._entered = contextlib.ExitStack()
        self._fp16 = TorchFp16Run(self.model)  # the clean verdict checked in real FP16
        try:
            self._entered.enter_context(self._fp16.kept_from(self.model))  # the first batches
            self._entered.enter_context(rec.tracker)  # module hooks
            self._entered.enter_context(rec)  # the dispatch mode
        except BaseException:
            self._entered.close()
            ACTIVE.discard(self.model)
            raise
        return self

    def _on_forward_end(self, fw) -> None:
        assert self._acc is not None  # forwards end only inside the block
        self._acc.add(fw)

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        rec, acc = self._recorder, self._acc
        assert rec is not None and acc is not None  # both made by __enter__
        try:
            rec.abort_forward()
        finally:
            rec.first = None  # the first call's meta inputs: no trace runs after the block
            try:
                self._entered.close()  # the mode left, then the hooks removed
            finally:
                ACTIVE.discard(self.model)
        if exc is not None:
            if rec.last_site and hasattr(exc, "add_note"):
                inside = f" (it raised inside {rec.raised_in!r})" if rec.raised_in else ""
                exc.add_note(
                    f"fp16lens.watch: the last site that ran was {rec.last_site!r}{inside}"
                )
            return False
        self._report = finished_report(acc, rec.sites, self._params, self.model, self.options)
        return False

    @property
    def report(self) -> Report:
        if self._report is None:
            if self._recorder is not None and self._acc is not None:
                return build_report(
                    self._acc,
                    self._recorder.sites,
                    self._params,
                    self.model,
                    self.options.threshold,
                )
            raise WatchError(
                "no report yet: use `with fp16lens.watch(model) as lens:` and run the model inside"
            )
        assert self._fp16 is not None  # a report exists only after a block
        self._fp16.settle(self._report)  # once, when the verdict is first read
        return self._report


def watch(
    model: torch.nn.Module,
    threshold: float | None = None,
    *,
    options: WatchOptions | None = None,
    **option_values: Any,
) -> Lens:
    """Record how close every module and functional op of ``model`` comes to FP16 limits.

    >>> with fp16lens.watch(model) as lens:
    ...     for x in batches:
    ...         model(x)
    >>> lens.report.print()
    """
    if threshold is not None:
        option_values["threshold"] = threshold
    return Lens(model, one_form(WatchOptions, options, option_values))
