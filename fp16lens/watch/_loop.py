"""The one scan loop: every front end (eager PyTorch, compiled, ONNX Runtime) and the CLI run
their batches through ``run_batches``.

It owns what a long scan needs in one place: the check of what was passed as batches, the
progress bar (batches done of the total), the error for an empty iterable, and Ctrl-C, which
becomes ``ScanInterrupted`` carrying the report of what ran. A front end plugs in through
the ``FrontEnd`` protocol: a ``session()`` around the batches, one ``step(index, batch)``
that runs one batch into its records (``Forward`` records of an ``Accumulator`` over its
own sites), and ``report(complete)`` that builds the report (``watch/_build.py`` for all of
them). ``scan_with`` runs one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sized
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from fp16lens._core import WatchError
from fp16lens._core.model_dtype import model_float_dtype
from fp16lens._trace import call_model
from fp16lens.report import Report

HOW = "pass a list of batches: scan(model, [x]), scan(model, [(x1, x2)]) or scan(model, loader)"
HOW_ONNX = "pass a list of batches: scan('model.onnx', [x]), [(x1, x2)] or [{'input': x}]"


class ScanInterrupted(KeyboardInterrupt):
    """Ctrl-C after ``done`` whole batches: ``report`` holds what ran (the statistics of the
    batch cut short up to the interrupt included, as watch keeps those of a forward that
    raises), attached by the front end that was scanning."""

    def __init__(self, done: int, total: int | None):
        super().__init__(
            f"interrupted after {done} of {total if total is not None else '?'} batches"
        )
        self.done, self.total = done, total
        self.report: Report | None = None


class FrontEnd(Protocol):
    """What a scan front end (eager PyTorch, compiled, ONNX Runtime) gives the loop."""

    def session(self) -> AbstractContextManager[Any]:
        """Entered around all the batches (hooks, no_grad); left before the report is built."""
        ...

    def step(self, index: int, batch: Any) -> None:
        """Run batch number ``index`` into the front end's records."""
        ...

    def report(self, complete: bool) -> Report | None:
        """The report of what ran: ``complete`` False after an interrupt (None when no
        batch ran), True at the end (parameters, notes and the plan's advice included)."""
        ...


def scan_with(
    make: Callable[[], FrontEnd],
    batches: Iterable[Any],
    *,
    progress: bool = True,
    description: str = "watching",
    how: str = HOW,
) -> tuple[FrontEnd, Report]:
    """Check ``batches``, then build the front end (``make()``) and run every batch through
    it under the progress bar; returns the front end and its complete report. Ctrl-C is a
    ScanInterrupted carrying the report of what ran."""
    check_batches(batches, how)
    front = make()
    try:
        with front.session():
            run_batches(batches, front.step, progress=progress, description=description, how=how)
    except ScanInterrupted as stop:
        stop.report = front.report(complete=False)
        raise
    report = front.report(complete=True)
    assert report is not None  # at least one batch ran (run_batches raises otherwise)
    return front, report


def check_batches(batches: Any, how: str = HOW) -> None:
    """What was passed as ``batches`` is an iterable of batches (not one bare tensor or array,
    not one dict of keywords, not empty)."""
    if hasattr(batches, "shape") and hasattr(batches, "dtype"):
        shape = "x".join(map(str, batches.shape)) or "scalar"
        raise WatchError(
            f"scan() got a bare {'tensor' if hasattr(batches, 'requires_grad') else 'array'} ({shape}), "
            f"which it would iterate over its first (batch) axis; {how}"
        )
    if isinstance(batches, Mapping):
        raise WatchError(
            f"scan() got a dict: one batch of keyword inputs is scan(model, [d]); {how}"
        )
    if not isinstance(batches, Iterable):
        raise WatchError(
            f"scan() needs an iterable of batches, got {type(batches).__name__}; {how}"
        )
    if isinstance(batches, Sized) and len(batches) == 0:
        raise WatchError(f"scan() got no batch (an empty {type(batches).__name__}); {how}")


def run_batches(
    batches: Iterable[Any],
    step: Callable[[int, Any], None],
    *,
    progress: bool = True,
    description: str = "watching",
    how: str = HOW,
    console=None,
) -> int:
    """``step(i, batch)`` for every batch, under one progress bar (shown from two batches
    on); returns how many ran. An empty iterable is a WatchError; Ctrl-C a ScanInterrupted."""
    from fp16lens._core.progress import progress_bar

    total = len(batches) if isinstance(batches, Sized) else None
    bar = progress_bar(console, disable=not progress or total == 1)
    done = 0
    with bar:
        task = bar.add_task(description, total=total)
        try:
            for batch in batches:
                step(done, batch)
                done += 1
                bar.advance(task)
        except KeyboardInterrupt as exc:  # the report of what ran is the front end's to attach
            raise ScanInterrupted(done, total) from exc
    if not done:
        raise WatchError(f"scan() got no batch (the iterable was empty); {how}")
    return done


def call_batch(model, batch: Any) -> None:
    """One batch of a torch front end; a failure from a float input of another dtype than the
    model's is a WatchError naming the cast."""
    try:
        call_model(model, batch)
    except (RuntimeError, TypeError) as exc:
        mismatch = dtype_mismatch(model, batch)
        if mismatch is None:
            raise
        raise WatchError(
            f"the model failed on its input ({mismatch}): {str(exc).splitlines()[0]}"
        ) from exc


def dtype_mismatch(model, batch: Any) -> str | None:
    """A sentence naming the first float input whose dtype is not the model's, with the cast."""
    want = model_float_dtype(model)
    items = (
        batch.items()
        if isinstance(batch, dict)
        else enumerate(batch if isinstance(batch, (tuple, list)) else (batch,))
    )
    for key, t in items:
        if want is not None and torch.is_tensor(t) and t.is_floating_point() and t.dtype != want:
            name = str(want).removeprefix("torch.")
            return (
                f"input {key!r} is {str(t.dtype).removeprefix('torch.')} but the model's "
                f"parameters are {name}: cast it with x.to(torch.{name}) (numpy arrays are "
                "float64 by default)"
            )
    return None
