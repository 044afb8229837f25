"""What differs between torch releases, or needs a torch-private name, in one place each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def dispatch_mode_paused(mode: TorchDispatchMode) -> Iterator[bool]:
    """``mode`` taken off the dispatch-mode stack while the block runs, and put back after,
    when it is the innermost mode (ops run inside then reach it no more); otherwise nothing
    changes. Yields whether it was paused. torch has no public way to do this: the two
    names below are private (present from torch 2.1 to 2.13)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if _get_current_dispatch_mode() is not mode:
        yield False
        return
    with _pop_mode_temporarily():
        yield True
