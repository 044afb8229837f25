"""watch(): the context manager that records a model's FP16 range over forward calls."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Literal

import torch

from fp16lens._core import WatchError
from fp16lens._core.options import one_form
from fp16lens._core.weights import missing_weights
from fp16lens.report import Report
from fp16lens.watch import _distributed
from fp16lens.watch._accumulate import Accumulator
from fp16lens.watch._advise import advised
from fp16lens.watch._build import build_report
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._params import check_parameters
from fp16lens.watch._recorder import Recorder

_ACTIVE: weakref.WeakSet = weakref.WeakSet()


def _check_model(model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise WatchError(
            f"watch() needs a torch.nn.Module, got {type(model).__name__}; "
            "pass the model object itself (not its output, state_dict or a path)"
        )
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise WatchError(
            "watch() cannot see inside a torch.compile'd model (compiled graphs bypass "
            "module hooks and eager ops); watch model._orig_mod (the uncompiled module) "
            "and call that one inside the block"
        )
    why = missing_weights(model)
    if why is not None:
        raise WatchError(f"watch() cannot run this model: {why}")
    if isinstance(model, torch.jit.ScriptModule):
        raise WatchError(
            "watch() needs an eager nn.Module; TorchScript modules run their own "
            "interpreter. Load the model from its Python definition instead"
        )
    if model in _ACTIVE:
        raise WatchError(
            "this model is already being watched by an enclosing watch() block; "
            "use one block (statistics accumulate over any number of forward calls)"
        )


class Lens:
    """The handle ``with fp16lens.watch(model) as lens`` gives; ``lens.report`` afterwards."""

    def __init__(self, model: torch.nn.Module, options: WatchOptions):
        _check_model(model)
        self.model = model
        self.options = options
        self._recorder: Recorder | None = None
        self._acc: Accumulator | None = None
        self._params: list = []
        self._report: Report | None = None
        self._entered = contextlib.ExitStack()

    def __enter__(self) -> Lens:
        _check_model(self.model)
        self._params = check_parameters(self.model, self.options) if self.options.params else []
        rec = Recorder(self.model, self.options, on_forward_end=self._on_forward_end)
        self._acc = Accumulator(self.options.threshold, rec.sites, half_dtypes=rec.half_dtypes_of)
        self._recorder = rec
        _ACTIVE.add(self.model)
        self._entered = contextlib.ExitStack()
        try:
            self._entered.enter_context(rec.tracker)  # module hooks
            self._entered.enter_context(rec)  # the dispatch mode
        except BaseException:
            self._entered.close()
            _ACTIVE.discard(self.model)
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
                _ACTIVE.discard(self.model)
        if exc is not None:
            if rec.last_site and hasattr(exc, "add_note"):
                inside = f" (it raised inside {rec.raised_in!r})" if rec.raised_in else ""
                exc.add_note(
                    f"fp16lens.watch: the last site that ran was {rec.last_site!r}{inside}"
                )
            return False
        report = build_report(acc, rec.sites, self._params, self.model, self.options.threshold)
        if _distributed.enabled(self.options.distributed):
            report = _distributed.merge_over_ranks(report)
        self._report = advised(self.model, report, self.options.advise)
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
