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
        on the caller's batches, else on inputs of the dtypes and value ranges the report
        recorded (never skipped silently: a PatchWarning says when it could not run).
    strict: raise PatchError where the plan leaves anything unresolved (or the proof in
        real FP16 fails) instead of warning (PatchWarning).
    min_cosine: the proof's parity tolerance: with batches, each float output of the
        patched model in real FP16 must have at least this cosine similarity to the
        original's FP32 output (0.999, verify's default for FP16), and be finite.
    max_rel: optionally, also at most this largest |fp16 - fp32| relative to the FP32
        output's largest |value|.
    max_rounds: how many times the proof may widen the fix and check again.
    fp32_spans: indices into ``report.spans`` kept FP32 end to end: every module running
        one of the span's sites becomes an FP32 island, those whose values are still
        beyond FP16 hand FP32 onward (the proof's last resort; ``patch/_widen.py``).
    fp32_modules: modules kept FP32 whole (an island each; "" is the whole model).
    """

    factor: float | None = None
    target: float = 2.0**13
    low_share: float = 0.01
    allow_non_power_of_two: bool = False
    extend: bool = True
    check: bool = True
    strict: bool = False
    min_cosine: float = 0.999
    max_rel: float | None = None
    max_rounds: int = 8
    fp32_spans: tuple[int, ...] = ()
    fp32_modules: tuple[str, ...] = ()

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
        if not (isinstance(self.min_cosine, (int, float)) and -1 <= self.min_cosine <= 1):
            raise PatchError(
                f"min_cosine must be within [-1, 1], got {self.min_cosine!r}; the default is 0.999"
            )
        if self.max_rel is not None and not (
            isinstance(self.max_rel, (int, float)) and self.max_rel > 0
        ):
            raise PatchError(f"max_rel must be a number > 0 or None, got {self.max_rel!r}")
        object.__setattr__(self, "fp32_spans", tuple(int(i) for i in self.fp32_spans))
        object.__setattr__(self, "fp32_modules", tuple(str(m) for m in self.fp32_modules))
