"""scan(): watch a model over an iterable of batches, with a progress bar."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fp16lens.report._model import Report
from fp16lens.watch._lens import watch


def call_model(model: torch.nn.Module, batch: Any):
    """A batch is a tensor, a tuple/list of positional arguments, or a dict of keywords."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def scan(model: torch.nn.Module, batches: Iterable[Any], *, progress: bool = True,
         description: str = "watching", **watch_options: Any) -> Report:
    """Run ``model`` on every batch under watch() (and torch.no_grad) and return the report."""
    from rich.console import Console
    from rich.progress import Progress

    total = len(batches) if hasattr(batches, "__len__") else None
    progress_bar = Progress(console=Console(stderr=True), transient=True, disable=not progress)
    with watch(model, **watch_options) as lens, torch.no_grad(), progress_bar as bar:
        task = bar.add_task(description, total=total)
        for batch in batches:
            call_model(model, batch)
            bar.advance(task)
    return lens.report
