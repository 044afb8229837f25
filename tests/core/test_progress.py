"""The progress bar of every long loop shows batches done out of the total."""

from __future__ import annotations

import io

from rich.console import Console

from fp16lens._core.progress import progress_bar


def test_the_bar_counts_batches_done_out_of_the_total():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with progress_bar(console) as bar:
        task = bar.add_task("watching", total=5)
        bar.advance(task, 3)
        bar.refresh()
        assert "3/5" in out.getvalue() and "watching" in out.getvalue()
