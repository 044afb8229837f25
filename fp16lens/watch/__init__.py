"""watch(): where a model's values leave FP16 range, and where they come back.

What other stages also read of a running model (module tracking, aten op names, the dtypes
of a ``.half()`` run) lives under the stages, in ``fp16lens._trace``.
"""

from fp16lens._core.callable_module import StageModule, stage_module
from fp16lens.watch._lens import Lens, watch
from fp16lens.watch._loop import ScanInterrupted
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._scan import scan

__all__ = [
    "Lens",
    "ScanInterrupted",
    "WatchOptions",
    "scan",
    "watch",
]


class _Watch(StageModule):
    """``fp16lens.watch``: the package, callable as ``watch(model, ...)`` (a context manager
    giving a ``Lens``); ``fp16lens.watch.WatchOptions`` and ``fp16lens.watch.scan`` too."""

    __call__ = staticmethod(watch)
    scan = staticmethod(scan)
    Lens = Lens
    WatchOptions = WatchOptions


entry = stage_module(__name__, _Watch, watch)
