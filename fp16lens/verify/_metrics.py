"""Parity metrics of one output, accumulated over batches (pure tensor math, no I/O).

cosine: of the flattened outputs, all batches together, reading FP32's values below 2^-14
as FP16 holds them; 1 where both outputs stay below 2^-14 (a score of 1e-8 against 0 says
nothing), as patch's proof and the verdict's check compare (``patch._prove.Fp16Runner.
parity``). max_abs: largest |fp16 - fp32|.
max_rel: max_abs relative to the reference's largest magnitude (scale-relative, so zeros
in the reference do not blow it up). sqnr_db: 10 log10(sum ref^2 / sum err^2).
topk_agreement: share of positions whose top-1 index along dim 1 (the class/channel dim)
agrees; for integer outputs, the share of equal values.
cosine_about_mean: the cosine of both outputs about FP32's mean over every value of every
batch (``_core.parity.about_mean``): what a plain cosine misses beside a shared offset (a
quality score of 2.5 to 4 off by 0.12). None where FP32's values do not vary, or vary by
less than FP16 itself holds (its own values rounded to FP16 reach below
``_core.parity.VARIES`` about that mean).
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp16lens._core import FP16_MAX, FP16_MIN_NORMAL, VerifyError
from fp16lens._core.flush import small_as_fp16
from fp16lens._core.parity import VARIES, about_mean, cosine, sqnr_db


@dataclass(frozen=True)
class OutputMetrics:
    """How one output of the candidate compares with the FP32 reference."""

    cosine: float | None
    max_abs: float | None
    max_rel: float | None
    sqnr_db: float | None
    topk_agreement: float | None
    nonfinite: bool = False
    numel: int = 0
    # "reference (1, 11, 8), candidate (1, 10, 8)" where an output's data-dependent length
    # differs (a decoder that stops at another step); compared zero-padded, and a failure
    shape_change: str | None = None
    cosine_about_mean: float | None = None

    def __repr__(self) -> str:
        return f"OutputMetrics({format_metrics(self)})"


def format_metrics(m: OutputMetrics) -> str:
    parts = [
        f"cosine={_fmt(m.cosine, '.6f')}",
        f"max_abs={_fmt(m.max_abs, '.3g')}",
        f"max_rel={_fmt(m.max_rel, '.3g')}",
        f"sqnr_db={_fmt(m.sqnr_db, '.1f')}",
    ]
    if m.cosine_about_mean is not None and m.cosine_about_mean < (m.cosine or 0.0):
        parts.append(f"cosine_about_mean={m.cosine_about_mean:.6f}")
    if m.topk_agreement is not None:
        parts.append(f"topk_agreement={m.topk_agreement:.3f}")
    if m.nonfinite:
        parts.append("nonfinite=True")
    if m.shape_change:
        parts.append(f"shape changes: {m.shape_change}")
    return ", ".join(parts)


def _fmt(x: float | None, spec: str) -> str:
    return "None" if x is None else format(x, spec)


class Accumulator:
    """Running sums for one output; ``update`` per batch, ``result`` at the end."""

    def __init__(self):
        self.dot = self.ref_sq = self.cand_sq = self.err_sq = 0.0
        self.ref_sum = self.cand_sum = 0.0
        # FP32's output rounded to FP16 (h) against it: whether it varies enough to judge
        self.half_sum = self.half_dot = self.half_sq = 0.0
        self.max_abs = self.ref_max = self.cand_max = 0.0
        self.agree = self.positions = self.numel = 0
        self.nonfinite = False
        self.is_float = True
        self.shape_change: str | None = None

    def update(
        self, ref: torch.Tensor, cand: torch.Tensor, free: AbstractSet[int] = frozenset()
    ) -> None:
        """Add one batch. ``free``: the axes whose length the candidate's graph leaves to
        the data (a Loop's steps); a length that differs there is compared zero-padded and
        recorded as a shape change, anywhere else it is the wrong candidate."""
        if ref.shape != cand.shape:
            differ = {i for i, (a, b) in enumerate(zip(ref.shape, cand.shape)) if a != b}
            if ref.dim() != cand.dim() or not differ <= set(free):
                raise VerifyError(
                    f"output shapes differ: reference {tuple(ref.shape)}, candidate "
                    f"{tuple(cand.shape)}; verify a candidate exported from (or patched from) "
                    "this model, on the same inputs"
                )
            self.shape_change = self.shape_change or (
                f"reference {tuple(ref.shape)}, candidate {tuple(cand.shape)}"
            )
            ref, cand = _padded(ref, cand)
        if not ref.is_floating_point():
            self.is_float = False
            self.agree += int((ref == cand.to(ref.dtype)).sum())
            self.positions += ref.numel()
            return
        ref, cand = ref.detach().double(), cand.detach().double().to(ref.device)
        self.numel += ref.numel()
        bad = ~torch.isfinite(cand) & torch.isfinite(ref)
        self.nonfinite |= bool(bad.any())
        err = cand - ref
        stored = small_as_fp16(ref)
        self.dot += float((stored * cand).sum())
        self.ref_sq += float((stored * stored).sum())
        self.cand_sq += float((cand * cand).sum())
        self.err_sq += float((err * err).sum())
        self.ref_sum += float(stored.sum())
        self.cand_sum += float(cand.sum())
        half = ref.clamp(-FP16_MAX, FP16_MAX).half().double()
        self.half_sum += float(half.sum())
        self.half_dot += float((stored * half).sum())
        self.half_sq += float((half * half).sum())
        if err.numel():
            worst_err = float(err.abs().nan_to_num(nan=math.inf, posinf=math.inf).max())
            self.max_abs = max(self.max_abs, worst_err)
            self.ref_max = max(self.ref_max, float(ref.abs().nan_to_num(nan=0.0).max()))
            self.cand_max = max(self.cand_max, float(cand.abs().nan_to_num(nan=0.0).max()))
        self._update_topk(ref, cand)

    def add(self, other: Accumulator) -> None:
        """Take in the sums of ``other`` (batches accumulated on their own): the same as
        having updated this one with each of its batches."""
        for sum_ in (
            *("dot", "ref_sq", "cand_sq", "err_sq", "ref_sum", "cand_sum"),
            *("half_sum", "half_dot", "half_sq", "agree", "positions", "numel"),
        ):
            setattr(self, sum_, getattr(self, sum_) + getattr(other, sum_))
        for peak in ("max_abs", "ref_max", "cand_max"):
            setattr(self, peak, max(getattr(self, peak), getattr(other, peak)))
        self.nonfinite |= other.nonfinite
        self.is_float &= other.is_float
        self.shape_change = self.shape_change or other.shape_change

    def _update_topk(self, ref: torch.Tensor, cand: torch.Tensor) -> None:
        if ref.dim() < 2 or ref.shape[1] < 2:
            return
        self.agree += int((ref.argmax(1) == cand.nan_to_num(nan=-math.inf).argmax(1)).sum())
        self.positions += ref.argmax(1).numel()

    def result(self) -> OutputMetrics:
        agreement = self.agree / self.positions if self.positions else None
        if not self.is_float:
            return OutputMetrics(
                None, None, None, None, agreement, False, self.positions, self.shape_change
            )
        tiny = max(self.ref_max, self.cand_max) < FP16_MIN_NORMAL and not self.nonfinite
        return OutputMetrics(
            cosine=1.0 if tiny else cosine(self.dot, self.ref_sq, self.cand_sq),
            max_abs=self.max_abs if math.isfinite(self.max_abs) else math.inf,
            max_rel=self.max_abs / self.ref_max
            if self.ref_max > 0
            else (0.0 if self.max_abs == 0 else math.inf),
            sqnr_db=sqnr_db(self.ref_sq, self.err_sq),
            topk_agreement=agreement,
            nonfinite=self.nonfinite,
            numel=self.numel,
            shape_change=self.shape_change,
            cosine_about_mean=1.0 if tiny else self._about_mean(),
        )

    def _about_mean(self) -> float | None:
        sums = (self.numel, self.ref_sum)
        held = about_mean(*sums, self.half_sum, self.half_dot, self.ref_sq, self.half_sq)
        if held is None or not held >= VARIES:
            return None
        return about_mean(*sums, self.cand_sum, self.dot, self.ref_sq, self.cand_sq)


def _padded(ref: torch.Tensor, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both zero-padded at the end of every axis to the larger length (``F.pad`` takes the
    last axis first)."""
    shape = [max(a, b) for a, b in zip(ref.shape, cand.shape)]

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, [p for s, n in zip(shape[::-1], t.shape[::-1]) for p in (0, s - n)])

    return pad(ref), pad(cand.to(ref.device))


def worst(values, lower_is_worse: bool = True) -> float | None:
    """The worst of some metric values (NaN counts as worst; None entries are skipped)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if any(math.isnan(v) for v in present):
        return math.nan
    return min(present) if lower_is_worse else max(present)


def site_departs(ref: torch.Tensor, cand: torch.Tensor, site_rel: float) -> bool:
    """A site departs when the candidate turns non-finite where the reference is finite, or
    its error exceeds ``site_rel`` times the reference's largest magnitude."""
    ref, cand = ref.detach().float(), cand.detach().float().to(ref.device)
    finite = torch.isfinite(ref)
    if bool((~torch.isfinite(cand) & finite).any()):
        return True
    if not bool(finite.any()):
        return False
    scale = float(ref[finite].abs().max())
    err = float((cand[finite] - ref[finite]).abs().max())
    return err > site_rel * scale if scale > 0 else err > 0
