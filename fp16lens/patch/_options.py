"""Options of plan()/patch(): a frozen dataclass validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fp16lens._core import FP16_MAX, PatchError, is_power_of_two


@dataclass(frozen=True)
class PatchOptions:
    """How plan() chooses and applies the rescaling.

    factor: one factor for every region (a power of two); None chooses one per region
        from the report's ranges.
    target: where a region's peak should land after rescaling (2^13 leaves 3 doublings
        of headroom below 65504).
    low_share: share of a region's non-zero values that should stay above 2^-14 (FP16's
        smallest normal) after rescaling; the factor is lowered to keep them when the
        peak allows it.
    allow_non_power_of_two: accept a factor that is not 2^k (it adds rounding).
    extend: grow a region backwards through homogeneous ops to absorbing producers
        (zero run-time cost); False, or where growth is blocked, an operand of an
        add/sub/cat that is not itself out of range gets one scalar multiply instead.
    check: after patching, compare the FP32 outputs of the original and the patched model
        on random inputs of the report's input shapes (when the report has them).
    """

    factor: float | None = None
    target: float = 2.0**13
    low_share: float = 0.01
    allow_non_power_of_two: bool = False
    extend: bool = True
    check: bool = True

    def __post_init__(self):
        f = self.factor
        if f is not None:
            if (
                isinstance(f, bool)
                or not isinstance(f, (int, float))
                or not math.isfinite(f)
                or f <= 0
            ):
                raise PatchError(
                    f"factor must be a finite number > 0 (a power of two such as 64), got {f!r}"
                )
            if not self.allow_non_power_of_two and not is_power_of_two(float(f)):
                near = 2.0 ** round(math.log2(f))
                raise PatchError(
                    f"factor {f!r} is not a power of two, so rescaling would add rounding; use "
                    f"{near:g}, or pass allow_non_power_of_two=True to accept the rounding"
                )
        if not (isinstance(self.target, (int, float)) and 1 <= self.target <= FP16_MAX):
            raise PatchError(
                f"target must be within [1, 65504], got {self.target!r}; the default is 8192"
            )
        if not 0 <= self.low_share < 1:
            raise PatchError(f"low_share must be within [0, 1), got {self.low_share!r}")
