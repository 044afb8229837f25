"""watch(): where a model's values leave FP16 range, and where they come back.

What other stages also read of a running model (module tracking, aten op names, the dtypes
of a ``.half()`` run) lives under the stages, in ``fp16lens._trace``.
"""

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
