"""Accuracy parity of an FP16 (or INT8) candidate against the FP32 model, with the first
diverging site named. ``result = verify(model, candidate, inputs)``; ``bool(result)``.

Backends are looked up by name in a registry (``backends()``); a new one is a ``Runner``
subclass registered with ``register_backend(BackendSpec(name, "module" or "path",
factory))``."""

from fp16lens._core.callable_module import StageModule, stage_module
from fp16lens.verify._metrics import OutputMetrics
from fp16lens.verify._options import Tolerance, VerifyOptions
from fp16lens.verify._registry import (
    BACKENDS,
    BackendSpec,
    backend_spec,
    backends,
    register_backend,
    unregister_backend,
)
from fp16lens.verify._result import ParityResult
from fp16lens.verify._runner import Runner
from fp16lens.verify._verify import verify

__all__ = [
    "BACKENDS",
    "BackendSpec",
    "OutputMetrics",
    "ParityResult",
    "Runner",
    "Tolerance",
    "VerifyOptions",
    "backend_spec",
    "backends",
    "register_backend",
    "unregister_backend",
    "verify",
]


class _Verify(StageModule):
    """``fp16lens.verify``: the package, callable as ``verify(model, candidate, inputs, ...)``."""

    __call__ = staticmethod(verify)
    backends = staticmethod(backends)
    register_backend = staticmethod(register_backend)
    ParityResult = ParityResult
    Tolerance = Tolerance
    VerifyOptions = VerifyOptions


entry = stage_module(__name__, _Verify, verify)
