"""Options of watch(): a frozen dataclass validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fp16lens._core import FP16_MAX, OptionError


@dataclass(frozen=True)
class WatchOptions:
    """What watch() records and how.

    threshold: values with |v| above it count as out of FP16 range (65504 by default;
        lower it to see near misses as overflow, e.g. 32768 for a 2x safety margin).
    ops: record every functional op (aten level), not only built-in leaf modules.
    internal: check overflow inside ops (norm variances, sums before a mean, ...).
    params: check parameters and buffers on entry.
    sample_size: elements sampled per call for the underflow shares and the
        per-binade histogram (the maximum is always exact, and so are overflow counts
        on the CPU; elsewhere they are estimated from the sample).
    param_subnormal_share / param_underflow_share: a parameter tensor is reported when
        values that are subnormal / flush to zero in FP16 carry at least this share of
        its magnitude (sum of |v|): a few stray tiny values next to large ones do not matter.
    distributed: merge statistics over torch.distributed ranks when the report is
        built: "auto" (when a process group is initialized), True or False.
    half_dtypes: follow the dtypes a ``.half()`` model computes in: ops that it still runs
        in FP32 (explicit upcasts such as ``x.float().pow(2)`` in RMS norms, FP32 tensors
        created in forward) cannot overflow FP16. Found by running the model once in FP16
        on the ``meta`` device (no arithmetic); skipped when the forward needs real values.
    advise: plan the fix with fp16lens.patch's planner when the report has problems, and
        store the plan in the report (``report.advice``, each span's and finding's ``fix``):
        the advice is what ``fp16lens.patch`` does. False: the fixes are worded from the
        report alone (no planning pass).
    """

    threshold: float = FP16_MAX
    ops: bool = True
    internal: bool = True
    params: bool = True
    sample_size: int = 1024
    param_subnormal_share: float = 0.05
    param_underflow_share: float = 0.01
    distributed: bool | str = "auto"
    half_dtypes: bool = True
    advise: bool = True

    def __post_init__(self):
        if not isinstance(self.threshold, (int, float)) or not (
            math.isfinite(self.threshold) and 0 < self.threshold <= FP16_MAX
        ):
            raise OptionError(
                f"threshold must be a number in (0, 65504], got {self.threshold!r}: FP16 holds "
                "nothing beyond 65504, so a higher one would pass values real FP16 makes inf; "
                "a lower one keeps a safety margin"
            )
        if not isinstance(self.sample_size, int) or self.sample_size < 16:
            raise OptionError(f"sample_size must be an int >= 16, got {self.sample_size!r}")
        for name in ("param_subnormal_share", "param_underflow_share"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise OptionError(f"{name} must be within [0, 1], got {v!r}")
        if self.distributed not in (True, False, "auto"):
            raise OptionError(
                f"distributed must be True, False or 'auto', got {self.distributed!r}"
            )
