"""One progress bar for every long loop of fp16lens (scans, calibration): rich's, on
stderr, showing the batches done out of the total beside the bar, the elapsed and the
remaining time; transient, so that nothing of it stays in a log."""

from __future__ import annotations


def progress_bar(console=None, disable: bool = False):
    """A ``rich.progress.Progress`` with the columns fp16lens shows everywhere."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console or Console(stderr=True),
        transient=True,
        disable=disable,
    )
