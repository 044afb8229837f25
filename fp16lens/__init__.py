"""fp16lens: find, explain and fix FP16 overflow in PyTorch models before TensorRT."""

# Stage subpackages that are callable as their main function: fp16lens.patch(model, report),
# fp16lens.export(model, inputs, path); their other names stay reachable (fp16lens.patch.plan).
from fp16lens import export, patch, verify
from fp16lens._core import Fp16LensError, MissingDependencyError
from fp16lens._core.version import __version__
from fp16lens.export import build_engine, compile_torch_tensorrt
from fp16lens.patch import PatchWarning, Plan, plan
from fp16lens.report import Finding, Report, SiteStats, Span
from fp16lens.verify import ParityResult, Tolerance
from fp16lens.watch import Lens, WatchOptions, scan, watch

__all__ = [
    "Finding",
    "Fp16LensError",
    "Lens",
    "MissingDependencyError",
    "ParityResult",
    "PatchWarning",
    "Plan",
    "Report",
    "SiteStats",
    "Span",
    "Tolerance",
    "WatchOptions",
    "__version__",
    "build_engine",
    "compile_torch_tensorrt",
    "export",
    "patch",
    "plan",
    "scan",
    "verify",
    "watch",
]
