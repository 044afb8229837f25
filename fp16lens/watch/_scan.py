"""scan(): watch a model over an iterable of batches, with a progress bar.

Inputs are passed as given: an input whose float dtype differs from the model's (numpy's
float64 arrays for a float32 model) is not cast, since the model may mean it (a model
that casts itself, a float64 model); when the forward then fails, the WatchError names
the mismatch and the cast to write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fp16lens._core import WatchError
from fp16lens.report import Report
from fp16lens.watch._lens import Lens, watch
from fp16lens.watch._loop import call_batch, scan_with
from fp16lens.watch._options import WatchOptions


def scan(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    progress: bool = True,
    description: str = "watching",
    compile: bool = False,
    options: WatchOptions | None = None,
    **watch_options: Any,
) -> Report:
    """Run ``model`` on every batch under watch() (and torch.no_grad) and return the report.

    The watch options are ``options=WatchOptions(...)`` or the same fields as keywords.
    ``batches`` is an iterable of batches (a list, a DataLoader): ``[x]`` for one batch of
    one input, ``[(x1, x2)]`` for one batch of two inputs, ``[{"x": x}]`` for keywords.
    ``model`` may also be an ONNX file (``"model.onnx"``) or an ``onnx.ModelProto``: it
    then runs in ONNX Runtime, with dict batches keyed by graph input name
    (``base_dir=`` names the folder of a proto's external data).

    ``compile=True`` (long scans of a torch module): the recorder's statistics are
    captured into one graph per input signature with the model's ops and compiled by
    Inductor (a CUDA graph on CUDA); the first batch runs eagerly, the second is
    captured, the third compiles. Where capture or compile fails, batches run eagerly
    and the report carries a note saying why.
    """
    from fp16lens._core.onnx_types import is_onnx
    from fp16lens.watch.onnx import scan_onnx

    if is_onnx(model):
        if compile:
            raise WatchError(
                "compile=True applies to torch modules; an ONNX model runs in ONNX Runtime "
                "(leave compile out)"
            )
        return scan_onnx(
            model,
            batches,
            progress=progress,
            description=description,
            options=options,
            **watch_options,
        )
    if compile:
        from fp16lens.watch._compiled_scan import scan_compiled

        return scan_compiled(
            model,
            batches,
            progress=progress,
            description=description,
            options=options,
            **watch_options,
        )[0]
    return scan_with(
        lambda: EagerScan(model, watch(model, options=options, **watch_options)),
        batches,
        progress=progress,
        description=description,
    )[1]


class EagerScan:
    """The eager front end: every batch a forward of ``model`` under one watch session."""

    def __init__(self, model: torch.nn.Module, lens: Lens):
        self.model, self.lens = model, lens  # the lens checks a clean verdict in real FP16

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        with self.lens, torch.no_grad():
            yield

    def step(self, index: int, batch: Any) -> None:
        call_batch(self.model, batch)

    def report(self, complete: bool) -> Report:
        return self.lens.report  # after an interrupt: the batch cut short included
