"""Bottom layer: FP16 facts, errors, optional imports and the site contract. Imports nothing else of fp16lens."""

from fp16lens._core.errors import (
    ExportError,
    Fp16LensError,
    MissingDependencyError,
    OptionError,
    OutputPathError,
    PatchError,
    ReportError,
    StaleReportError,
    UnknownBackendError,
    VerifyError,
    WatchError,
)
from fp16lens._core.fp16 import (
    FP16_MAX,
    FP16_MIN_NORMAL,
    FP16_MIN_SUBNORMAL,
    half_step,
    headroom_bits,
    is_power_of_two,
)
from fp16lens._core.optional import import_optional

__all__ = [
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "FP16_MIN_SUBNORMAL",
    "ExportError",
    "Fp16LensError",
    "MissingDependencyError",
    "OptionError",
    "OutputPathError",
    "PatchError",
    "ReportError",
    "StaleReportError",
    "UnknownBackendError",
    "VerifyError",
    "WatchError",
    "half_step",
    "headroom_bits",
    "import_optional",
    "is_power_of_two",
]
