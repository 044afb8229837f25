"""scan(): watch a model over an iterable of batches, with a progress bar.

Inputs are passed as given: an input whose float dtype differs from the model's (numpy's
float64 arrays for a float32 model) is not cast, since the model may mean it (a model
that casts itself, a float64 model); when the forward then fails, the WatchError names
the mismatch and the cast to write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fp16lens._core import WatchError
from fp16lens._core.model_dtype import model_float_dtype
from fp16lens.report import Report
from fp16lens.watch._lens import watch

_HOW = "pass a list of batches: scan(model, [x]), scan(model, [(x1, x2)]) or scan(model, loader)"


def call_model(model: torch.nn.Module, batch: Any):
    """A batch is a tensor, a tuple/list of positional arguments, or a dict of keywords."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def scan(model: torch.nn.Module, batches: Iterable[Any], *, progress: bool = True,
         description: str = "watching", compile: bool = False, **watch_options: Any) -> Report:
    """Run ``model`` on every batch under watch() (and torch.no_grad) and return the report.

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
    from fp16lens.watch.onnx import is_onnx_model, scan_onnx

    if is_onnx_model(model):
        _check_batches(batches)
        if compile:
            raise WatchError("compile=True applies to torch modules; an ONNX model runs in ONNX Runtime "
                             "(leave compile out)")
        return scan_onnx(model, batches, progress=progress, description=description, **watch_options)
    from fp16lens._core.progress import progress_bar as make_bar

    _check_batches(batches)
    if compile:
        from fp16lens.watch._compiled_scan import scan_compiled

        return scan_compiled(model, batches, progress=progress, description=description, **watch_options)[0]
    total = len(batches) if hasattr(batches, "__len__") else None
    progress_bar = make_bar(disable=not progress)
    seen = 0
    with watch(model, **watch_options) as lens, torch.no_grad(), progress_bar as bar:
        task = bar.add_task(description, total=total)
        for batch in batches:
            _call(model, batch)
            seen += 1
            bar.advance(task)
    if not seen:
        raise WatchError(f"scan() got no batch (the iterable was empty); {_HOW}")
    return lens.report


def _check_batches(batches: Any) -> None:
    if torch.is_tensor(batches):
        shape = "x".join(map(str, batches.shape)) or "scalar"
        raise WatchError(
            f"scan() got a bare tensor ({shape}), which it would iterate over its first "
            f"(batch) axis; {_HOW}"
        )
    if isinstance(batches, Mapping):
        raise WatchError(f"scan() got a dict: one batch of keyword inputs is scan(model, [d]); {_HOW}")
    if not isinstance(batches, Iterable):
        raise WatchError(f"scan() needs an iterable of batches, got {type(batches).__name__}; {_HOW}")
    if hasattr(batches, "__len__") and len(batches) == 0:
        raise WatchError(f"scan() got no batch (an empty {type(batches).__name__}); {_HOW}")


def _call(model: torch.nn.Module, batch: Any) -> None:
    try:
        call_model(model, batch)
    except (RuntimeError, TypeError) as exc:
        mismatch = dtype_mismatch(model, batch)
        if mismatch is None:
            raise
        raise WatchError(f"the model failed on its input ({mismatch}): {str(exc).splitlines()[0]}") from exc


def dtype_mismatch(model: torch.nn.Module, batch: Any) -> str | None:
    """A sentence naming the first float input whose dtype is not the model's, with the cast."""
    want = model_float_dtype(model)
    items = batch.items() if isinstance(batch, dict) else enumerate(
        batch if isinstance(batch, (tuple, list)) else (batch,)
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
