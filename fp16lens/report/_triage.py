"""What matters most, and what each internal risk does on TensorRT (pure)."""

from __future__ import annotations

import math

from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report._advice import headline, param_name, suggest_fix
from fp16lens.report._fmt import value
from fp16lens.report._model import Finding, Report, Span

_PARAM_RANK: dict[str, int] = {  # by Finding.kind (a str)
    FindingKind.PARAM_OVERFLOW: 3,
    FindingKind.PARAM_UNDERFLOW: 5,
    FindingKind.PARAM_SUBNORMAL: 6,
}


def _rank(item: Span | Finding) -> tuple[int, float]:
    """Lower ranks first: broken data, broken model, stored overflow, silent errors, risks."""
    peak = item.peak if math.isfinite(item.peak) else math.inf
    if isinstance(item, Span):
        return (1 if math.isinf(peak) else 2 + item.fused * 2, -peak)
    if item.mechanism == Mechanism.INPUT:
        return (0, -peak)
    if item.mechanism == Mechanism.UNDERFLOW:  # FP16 itself makes inf/NaN: as bad as an inf span
        return (1, -item.count)
    if item.mechanism == Mechanism.PARAMETER:
        return (_PARAM_RANK.get(item.kind, 3), -peak)
    if item.mechanism == Mechanism.NOTE:
        return (7, -peak)
    if item.kind == FindingKind.FP16_RUN:  # measured in FP16 storage, before mere risks
        return (3, -peak)
    return (4, -peak)


def problems(report: Report) -> list[Span | Finding]:
    """Spans and the findings a span does not already stand for, most important first."""
    starts = {s.start for s in report.spans}
    items: list[Span | Finding] = list(report.spans)
    items += [
        f for f in report.findings if not (f.mechanism == Mechanism.OUTPUT and f.site in starts)
    ]
    return sorted(items, key=_rank)


def next_step(report: Report) -> str:
    """The single most important thing to do, or "" for a clean report."""
    items = [
        i
        for i in problems(report)
        if not (isinstance(i, Finding) and i.mechanism == Mechanism.NOTE)
    ]
    if not items:
        return ""
    first = items[0]
    fix = suggest_fix(report, first)
    if isinstance(first, Span):
        return f"{headline(fix)} — span {report.spans.index(first) + 1} below"
    where = first.site or param_name(first)
    return f"{headline(fix)} — {where} below"


def _norm_consequence(f: Finding) -> str:
    if f.tensor == "LayerNorm":
        graph = "exported below opset 17, LayerNorm becomes ReduceMean, Sub, Pow, ReduceMean"
    elif f.tensor == "GroupNorm":
        graph = "exported below opset 18, GroupNorm becomes reshapes around InstanceNormalization or Pow/ReduceMean"
    else:
        graph = "the variance is computed as mean((x-mean)^2)"
    return (
        f"On TensorRT: {graph}; in FP16 (x-mean)^2 reaches {value(f.peak)} > 65504, the "
        "variance is inf and the output silently collapses to the bias (or NaN)"
    )


def trt_consequence(f: Finding) -> str:
    """One sentence on what an internal risk does in a TensorRT FP16 engine ("" if none)."""
    if f.mechanism != Mechanism.INTERNAL:
        return ""
    if f.kind == FindingKind.NORM_VARIANCE:
        return _norm_consequence(f)
    if f.kind == FindingKind.RMS_SQUARE:
        return (
            f"On TensorRT: a decomposed RMSNorm (Pow, ReduceMean, Sqrt) stores x^2 up to "
            f"{value(f.peak)} in FP16: inf, and the output becomes 0"
        )
    if f.kind == FindingKind.SUM_BEFORE_MEAN:
        return (
            f"On TensorRT: where the reduction accumulates in FP16 (a ReduceSum before the "
            f"division, an FP16 pooling kernel), the sum reaches {value(f.peak)}: inf, and "
            "so is the mean"
        )
    if f.kind == FindingKind.ATTENTION_SCORES:
        return (
            f"On TensorRT: an unfused attention (MatMul, Softmax) stores the scores "
            f"({value(f.peak)}) in FP16: inf, and the softmax turns them into NaN; a fused "
            "attention kernel keeps them in FP32"
        )
    if f.kind == FindingKind.SUM_OF_SQUARES:
        return (
            f"On TensorRT: ReduceL2/ReduceSumSquare in FP16 stores the sum of squares "
            f"({value(f.peak)}): inf"
        )
    return f"On TensorRT: {value(f.peak)} is stored inside the op in FP16: inf"
