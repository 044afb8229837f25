"""fp16lens: find, explain and fix FP16 overflow in PyTorch models before TensorRT."""

__version__ = "0.1.0"

from fp16lens._core import Fp16LensError, MissingDependencyError
from fp16lens.report import Finding, Report, SiteStats, Span
from fp16lens.watch import Lens, WatchOptions, scan, watch

__all__ = [
    "Finding",
    "Lens",
    "Fp16LensError",
    "MissingDependencyError",
    "Report",
    "SiteStats",
    "Span",
    "WatchOptions",
    "__version__",
    "scan",
    "watch",
]
