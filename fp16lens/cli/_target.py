"""``fp16lens export --target``: the INT8 parity target as a terminal states it.

- ``0.999``: the worst output cosine to FP32 (as ``export(..., target=0.999)``);
- ``NAME=VALUE``: a target ``fp16lens.export`` names (``cosine``, ``mean-cosine``,
  ``sqnr`` in dB, ``top1``, ``ctc``; ``_int8_metrics.NAMED``);
- ``FILE.py:FUNC=VALUE`` or ``package.module:FUNC=VALUE``: the user's own task metric,
  ``FUNC(refs, outs) -> float`` (per batch, the FP32 and INT8 graph outputs as lists of
  numpy arrays), held at ``>= VALUE``.

The text is checked when the command line is read (one line, exit 2, before any model
loads); a user's metric is imported when the export runs, and what goes wrong there (no
such file, a metric that raises or returns no number) is one line too.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from fp16lens._core import Fp16LensError

FORMS = (
    "a worst output cosine in (0, 1] (e.g. 0.999), NAME=VALUE with NAME one of {names} "
    "(e.g. sqnr=30), or FILE.py:FUNC=VALUE for your own metric FUNC(refs, outs) -> float"
)


GIVEN = (
    "it is given refs and outs: per batch, the FP32 and INT8 graph outputs as lists of numpy "
    "arrays, and returns a float"
)


@dataclass(frozen=True)
class TargetSpec:
    """``--target`` as read: a named target (``name``) or a user's metric (``metric``, as
    ``FILE.py:FUNC`` or ``module:FUNC``), and its threshold."""

    threshold: float
    name: str = "cosine"
    metric: str | None = None

    def resolve(self):
        """The ``Int8Target`` for ``export(..., target=)`` (the worst output cosine's is
        the one a plain number gives)."""
        from fp16lens.export import Int8Target

        if self.metric is None:
            return Int8Target.named(self.name, self.threshold)
        return Int8Target(self.threshold, _UserMetric(self.metric, _load(self.metric)), self.metric)


def parse_target(text: str) -> TargetSpec:
    """argparse ``type`` of ``--target``: ArgumentTypeError (argparse's one line, exit 2)
    for a text none of the forms reads."""
    from fp16lens.export import ExportError, Int8Target

    def refuse(why: str = "") -> argparse.ArgumentTypeError:
        forms = FORMS.format(names=", ".join(Int8Target.NAMES))
        return argparse.ArgumentTypeError(f"{why}give {forms}; not {text!r}")

    name, eq, value = text.strip().rpartition("=")
    name = name.rstrip(">").strip()  # "sqnr>=30" reads as "sqnr=30"
    if not eq:
        name = "cosine"
    try:
        threshold = float(value)
    except ValueError:
        raise refuse() from None
    if not math.isfinite(threshold):
        raise refuse()
    if ":" in name:
        source, _, func = name.rpartition(":")
        if not source or not func.isidentifier():
            raise refuse("a metric is FILE.py:FUNC or module:FUNC; ")
        return TargetSpec(threshold, metric=name)
    try:
        Int8Target.named(name, threshold)
    except ExportError as exc:
        raise refuse(f"{exc}; ") from None
    return TargetSpec(threshold, name=name)


def _load(spec: str):
    """The callable ``spec`` (``FILE.py:FUNC`` or ``module:FUNC``) names."""
    from fp16lens.cli._models import _import

    source, _, func = spec.rpartition(":")
    if source.endswith(".py") and not Path(source).is_file():
        raise Fp16LensError(f"--target {spec}: no file {source}; check the path")
    try:
        module = _import(source)
    except Fp16LensError as exc:
        raise Fp16LensError(f"--target {spec}: {exc}") from exc
    metric = getattr(module, func, None)
    if not callable(metric):
        raise Fp16LensError(
            f"--target {spec}: {source} has no callable {func!r}; the metric is "
            "FUNC(refs, outs) -> float"
        )
    return metric


class _UserMetric:
    """A user's metric, each call checked: what it raises or a result that is not a
    finite number is one line naming the metric and what it is given."""

    def __init__(self, spec: str, metric):
        self.spec, self.metric = spec, metric

    def __call__(self, refs, outs) -> float:
        try:
            value = self.metric(refs, outs)
        except Exception as exc:
            raise Fp16LensError(
                f"--target {self.spec} raised {type(exc).__name__}: {exc}; {GIVEN}"
            ) from exc
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise Fp16LensError(f"--target {self.spec} returned {value!r}, not a number; {GIVEN}")
        return number
