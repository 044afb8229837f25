"""fp16lens: find, explain and fix FP16 overflow in PyTorch models before TensorRT."""

# The stage packages watch, patch, export and verify are callable as their main function
# (fp16lens.patch(model, report), typed and with that function's inspect.signature), and
# stay packages (fp16lens.patch.plan, from fp16lens.patch import PatchOptions):
# fp16lens/_core/callable_module.py.
from fp16lens._core import Fp16LensError, MissingDependencyError
from fp16lens._core.version import __version__
from fp16lens.export import ExportArtifact, ExportOptions, build_engine, compile_torch_tensorrt
from fp16lens.export import entry as export
from fp16lens.patch import PatchOptions, PatchWarning, Plan, get_plan, plan
from fp16lens.patch import entry as patch
from fp16lens.report import Finding, Report, SiteStats, Span
from fp16lens.verify import ParityResult, Tolerance, VerifyOptions
from fp16lens.verify import entry as verify
from fp16lens.watch import Lens, WatchOptions, scan
from fp16lens.watch import entry as watch

__all__ = [
    "ExportArtifact",
    "ExportOptions",
    "Finding",
    "Fp16LensError",
    "Lens",
    "MissingDependencyError",
    "ParityResult",
    "PatchOptions",
    "PatchWarning",
    "Plan",
    "Report",
    "SiteStats",
    "Span",
    "Tolerance",
    "VerifyOptions",
    "WatchOptions",
    "__version__",
    "build_engine",
    "compile_torch_tensorrt",
    "export",
    "get_plan",
    "patch",
    "plan",
    "scan",
    "verify",
    "watch",
]


def __getattr__(name: str):
    """``fp16lens.demo`` (the built-in model and the end-to-end demo, as the README writes
    it) imported on first use: ``import fp16lens`` stays light."""
    if name == "demo":
        import importlib

        return importlib.import_module("fp16lens.demo")
    raise AttributeError(f"module 'fp16lens' has no attribute {name!r}")
