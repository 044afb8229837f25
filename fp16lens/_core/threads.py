"""CPU threads for fp16lens's own statistics passes (extremes, samples, norms).

A reduction over a few MB is done in well under a millisecond by one thread, but a parallel
region waits for every thread of the pool: on a busy machine one that the OS has parked
costs a scheduling slice (10-20 ms measured on a loaded 2-core VM, against 0.4 ms on one
thread). So a pass gets one thread per ``PER_THREAD`` elements, at most the current count,
and the count is restored before the model's next op. Only with the OpenMP backend, where
the count can be changed at any time (the native backend warns after its pool started).
"""

from __future__ import annotations

import functools

import torch

PER_THREAD = 1 << 20  # elements: ~1 ms of a memory-bound pass on one thread


@functools.cache
def _adjustable() -> bool:
    return "OpenMP" in torch.__config__.parallel_info()


def narrow(numel: int) -> int:
    """Use fewer CPU threads for a pass over ``numel`` elements; returns the count to give
    ``restore`` (0 when nothing changed)."""
    now = torch.get_num_threads()
    want = max(1, numel // PER_THREAD)
    if want >= now or not _adjustable():
        return 0
    torch.set_num_threads(want)
    return now


def restore(previous: int) -> None:
    if previous:
        torch.set_num_threads(previous)


def on_threads(fn, t: torch.Tensor, *args):
    """``fn(t, *args)`` with the CPU threads a pass over ``t`` is worth (``narrow``)."""
    previous = narrow(t.numel()) if t.is_cpu else 0
    try:
        return fn(t, *args)
    finally:
        restore(previous)
