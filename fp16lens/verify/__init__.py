"""Accuracy parity of an FP16 (or INT8) candidate against the FP32 model, with the first
diverging site named. ``result = verify(model, candidate, inputs)``; ``bool(result)``."""

from fp16lens.verify._metrics import OutputMetrics
from fp16lens.verify._options import BACKENDS, Tolerance
from fp16lens.verify._result import ParityResult
from fp16lens.verify._verify import verify

__all__ = ["BACKENDS", "OutputMetrics", "ParityResult", "Tolerance", "verify"]

from fp16lens._core.callable_module import make_callable

make_callable(__name__, verify)
