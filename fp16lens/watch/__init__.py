"""watch(): where a model's values leave FP16 range, and where they come back.

Later stages also use its module tracking (``ModuleTracker``, ``Frame``) and its view of
aten ops (``op_name``, ``FACTORY``, ``PASSTHROUGH``, ``is_builtin_leaf``, and which ops a
``.half()`` model runs in FP32: ``fp32_compute_ops``, ``compute_index``).
"""

from fp16lens._core.callable_module import StageModule, stage_module
from fp16lens.watch._halfdtypes import compute_index, fp32_compute_ops
from fp16lens.watch._lens import Lens, watch
from fp16lens.watch._ops import FACTORY, PASSTHROUGH, is_builtin_leaf, op_name
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._scan import call_model, scan
from fp16lens.watch._tracker import Frame, ModuleTracker

__all__ = [
    "FACTORY",
    "PASSTHROUGH",
    "Frame",
    "Lens",
    "ModuleTracker",
    "WatchOptions",
    "call_model",
    "compute_index",
    "fp32_compute_ops",
    "is_builtin_leaf",
    "op_name",
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
