"""The parity verdict: truthy when it passed; a short repr that never dumps tensors."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from fp16lens.verify._metrics import OutputMetrics, worst
from fp16lens.verify._options import Tolerance


@dataclass(frozen=True)
class ParityResult:
    """FP16 (or INT8) candidate vs the FP32 model, over every batch.

    ``outputs``: per-output metrics (name -> OutputMetrics); the scalar metrics are the
    worst over float outputs. ``first_divergence``: the first site (module qualified name,
    ``module:op`` for a functional op, or an ONNX tensor name when its node carries no
    module) whose output departs beyond ``tolerance.site_rel`` or turns non-finite;
    ``first_divergence_tensor`` the ONNX tensor behind it for ONNX backends.
    ``metrics``: the task metric, when one was given (name -> value). ``advice``: for a
    failed INT8 check, the layers whose quantization loses most and what to try.
    """

    backend: str  # a Backend member for the built-in backends (equal to its string)
    outputs: dict[str, OutputMetrics]
    tolerance: Tolerance
    batches: int
    first_divergence: str | None = None
    first_divergence_tensor: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()

    @property
    def _float_outputs(self) -> list[OutputMetrics]:
        return [m for m in self.outputs.values() if m.cosine is not None]

    @property
    def cosine(self) -> float | None:
        return worst(m.cosine for m in self._float_outputs)

    @property
    def cosine_about_mean(self) -> float | None:
        """The worst float output's cosine about FP32's mean (None where no output varies
        enough to say: ``OutputMetrics.cosine_about_mean``)."""
        return worst(m.cosine_about_mean for m in self._float_outputs)

    @property
    def max_abs(self) -> float | None:
        return worst((m.max_abs for m in self._float_outputs), lower_is_worse=False)

    @property
    def max_rel(self) -> float | None:
        return worst((m.max_rel for m in self._float_outputs), lower_is_worse=False)

    @property
    def sqnr_db(self) -> float | None:
        return worst(m.sqnr_db for m in self._float_outputs)

    @property
    def topk_agreement(self) -> float | None:
        return worst(m.topk_agreement for m in self._float_outputs)

    @property
    def nonfinite(self) -> bool:
        return any(m.nonfinite for m in self.outputs.values())

    @property
    def passed(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """Why the check failed, one line per broken criterion (empty when it passed)."""
        return [
            why
            for name, m in self.outputs.items()
            for why in output_failures(name, m, self.tolerance)
        ]

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": str(self.backend),
            "passed": self.passed,
            "cosine": self.cosine,
            "cosine_about_mean": self.cosine_about_mean,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "sqnr_db": self.sqnr_db,
            "topk_agreement": self.topk_agreement,
            "nonfinite": self.nonfinite,
            "first_divergence": self.first_divergence,
            "first_divergence_tensor": self.first_divergence_tensor,
            "batches": self.batches,
            "metrics": dict(self.metrics),
            "outputs": {k: dataclasses.asdict(v) for k, v in self.outputs.items()},
            "tolerance": dataclasses.asdict(self.tolerance),
            "failures": self.failures(),
            "advice": list(self.advice),
        }

    def __repr__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        where = f", first_divergence={self.first_divergence!r}" if self.first_divergence else ""
        return (
            f"ParityResult({verdict}, backend={str(self.backend)!r}, cosine={_short(self.cosine)}, "
            f"max_rel={_short(self.max_rel)}, nonfinite={self.nonfinite}{where}, "
            f"outputs={len(self.outputs)}, batches={self.batches})"
        )

    def __rich_console__(self, console, options):
        from fp16lens.verify._render import render

        yield from render(self)


def output_failures(name: str, m: OutputMetrics, tol: Tolerance) -> list[str]:
    """The criteria one output breaks (an integer output only its shape)."""
    out = []
    if m.shape_change:
        out.append(f"{name}: its length changes ({m.shape_change})")
    if m.max_abs is None:
        return out  # not a float output
    if m.nonfinite:
        out.append(f"{name}: candidate holds inf/NaN where FP32 is finite")
    if m.cosine is None or math.isnan(m.cosine) or m.cosine < tol.min_cosine:
        out.append(f"{name}: cosine {_short(m.cosine)} < {tol.min_cosine}")
    elif (
        tol.about_mean and m.cosine_about_mean is not None and m.cosine_about_mean < tol.min_cosine
    ):
        out.append(
            f"{name}: cosine about FP32's mean {_short(m.cosine_about_mean)} < "
            f"{tol.min_cosine} (the plain cosine {_short(m.cosine)} hides the error "
            "beside the values' shared offset)"
        )
    if tol.max_rel is not None and not (m.max_rel is not None and m.max_rel <= tol.max_rel):
        out.append(f"{name}: max_rel {_short(m.max_rel)} > {tol.max_rel}")
    if tol.min_sqnr_db is not None and not (m.sqnr_db is not None and m.sqnr_db >= tol.min_sqnr_db):
        out.append(f"{name}: sqnr {_short(m.sqnr_db)} dB < {tol.min_sqnr_db} dB")
    return out


def _short(x: float | None) -> str:
    return "None" if x is None else f"{x:.6g}"
