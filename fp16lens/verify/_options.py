"""Pass criteria of a parity check: a small frozen dataclass, validated on creation."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fp16lens._core import OptionError


@dataclass(frozen=True)
class Tolerance:
    """When a candidate passes, and when one site's output counts as departed.

    ``min_cosine``: every float output's cosine similarity to the FP32 reference is at
    least this. ``about_mean``: so is each output's cosine about FP32's mean, over all
    batches, where FP32's values vary (``OutputMetrics.cosine_about_mean``: a score's error
    beside the offset the scores share, which the plain cosine cannot see); None: the
    backend's default, on for INT8, whose only check is this comparison, off for FP16,
    whose verdicts rest on the ranges first and judge the plain cosine as patch's proof
    does (on FP16's rounding Silero VAD's speech probabilities move by up to 0.1, 0.997
    about their mean, each decision at 0.5 the same). ``max_rel``: optionally, every
    output's largest error relative to the reference's largest magnitude is at most this. ``min_sqnr_db``: optionally, the
    signal-to-quantization-noise ratio is at least this. ``site_rel``: a site (module or
    ONNX tensor) departs when its error exceeds this share of its FP32 output's scale, or
    when it turns non-finite where FP32 is finite (used for ``first_divergence``).
    """

    min_cosine: float = 0.999
    max_rel: float | None = None
    min_sqnr_db: float | None = None
    site_rel: float = 0.05
    about_mean: bool | None = None

    def __post_init__(self):
        if not (isinstance(self.min_cosine, (int, float)) and -1.0 <= self.min_cosine <= 1.0):
            raise OptionError(f"min_cosine must be in [-1, 1], got {self.min_cosine!r}")
        if self.max_rel is not None and not _positive(self.max_rel):
            raise OptionError(f"max_rel must be a finite number > 0 or None, got {self.max_rel!r}")
        if self.min_sqnr_db is not None and not _finite(self.min_sqnr_db):
            raise OptionError(
                f"min_sqnr_db must be a finite number or None, got {self.min_sqnr_db!r}"
            )
        if not _positive(self.site_rel):
            raise OptionError(f"site_rel must be a finite number > 0, got {self.site_rel!r}")
        if self.about_mean is not None and not isinstance(self.about_mean, bool):
            raise OptionError(f"about_mean must be True, False or None, got {self.about_mean!r}")


def resolve_tolerance(tolerance: Tolerance | float | None, default: Tolerance) -> Tolerance:
    """A Tolerance (its ``about_mean`` None: the ``default``'s), the backend's ``default``
    for None, or a bare number taken as min_cosine (the rest from ``default``)."""
    about = bool(default.about_mean)
    if tolerance is None:
        return dataclasses.replace(default, about_mean=about)
    if isinstance(tolerance, Tolerance):
        if tolerance.about_mean is None:  # the backend's default
            return dataclasses.replace(tolerance, about_mean=about)
        return tolerance
    if isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool):
        return dataclasses.replace(default, min_cosine=float(tolerance), about_mean=about)
    raise TypeError(
        f"tolerance must be a fp16lens.verify.Tolerance, a number (min cosine) or None, "
        f"got {type(tolerance).__name__}"
    )


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x) -> bool:
    return _finite(x) and x > 0


@dataclass(frozen=True)
class VerifyOptions:
    """How ``verify`` compares; pass ``options=VerifyOptions(...)`` or the same fields as
    keywords of ``verify``.

    ``backend``: a registered backend name (``fp16lens.verify.backends()``), None or "auto"
    to pick one from the candidate. ``tolerance``: a Tolerance, or a number taken as the
    minimum cosine (None: the backend's default). ``metric(fp32_out, cand_out)``: a task
    metric averaged over batches. ``fusions``: torch-emulated keeps TensorRT-fused
    pre-activations unrounded. ``device``: where the torch backends run the candidate.
    ``about_mean``: hold each output's cosine about FP32's mean to the tolerance too (None:
    the tolerance's, ``Tolerance.about_mean``; where both say, they must agree).
    """

    backend: str | None = None
    tolerance: Tolerance | float | None = None
    metric: Callable[[Any, Any], float] | None = None
    fusions: bool = False
    device: Any = None  # str | torch.device | None
    about_mean: bool | None = None

    def __post_init__(self):
        if self.backend is not None and not isinstance(self.backend, str):
            raise OptionError(
                f"backend must be a backend name (fp16lens.verify.backends()), got {self.backend!r}"
            )
        if self.tolerance is not None and (
            isinstance(self.tolerance, bool)
            or not isinstance(self.tolerance, (Tolerance, int, float))
        ):
            raise OptionError(
                "tolerance must be a fp16lens.verify.Tolerance, a number (min cosine) or None, "
                f"got {type(self.tolerance).__name__}"
            )
        if self.metric is not None and not callable(self.metric):
            raise OptionError(
                f"metric must be a function (fp32_out, cand_out) -> float, got {self.metric!r}"
            )
        if not isinstance(self.fusions, bool):
            raise OptionError(f"fusions must be True or False, got {self.fusions!r}")
        if self.about_mean is not None and not isinstance(self.about_mean, bool):
            raise OptionError(f"about_mean must be True, False or None, got {self.about_mean!r}")
        held = getattr(self.tolerance, "about_mean", None)
        if self.about_mean is not None and held is not None and held != self.about_mean:
            raise OptionError(
                f"about_mean={self.about_mean} and the tolerance's about_mean={held} disagree: "
                "set it in one place (Tolerance(about_mean=...) or verify's about_mean)"
            )
