"""Turn the accumulated statistics into a Report (plain data)."""

from __future__ import annotations

import math

import torch

from fp16lens._core.fingerprint import fingerprint
from fp16lens._core.sites import INPUT_WORDS, FindingKind, Mechanism, input_label
from fp16lens._core.version import __version__
from fp16lens._trace import model_class
from fp16lens.report import Finding, Report, ReportMeta, SiteStats, Span
from fp16lens.watch import _internal
from fp16lens.watch._accumulate import Accumulator, SiteAcc, SiteCounts, SpanAcc
from fp16lens.watch._harm import judge
from fp16lens.watch._params import ParamCheck
from fp16lens.watch._recorder import SiteInfo
from fp16lens.watch._underflow import findings as underflow_findings

LN_FP16_MAX = math.log(65504.0)


def _site_stats(info: SiteInfo, acc: SiteAcc, c: SiteCounts) -> SiteStats:
    return SiteStats(
        name=info.name,
        kind=info.kind,
        op=info.op,
        module=info.module,
        order=info.order,
        calls=acc.calls,
        absmax=acc.absmax,
        absmax_batch=acc.absmax_batch,
        numel=acc.numel,
        zeros=round(c.zeros),
        nonfinite=round(c.nonfinite),
        overflow=round(c.overflow),
        subnormal=round(c.subnormal),
        underflow=round(c.underflow),
        saturated=acc.saturated,
        hist=[round(h) for h in c.hist],
        shape=list(acc.shape),
    )


def _span(acc: SpanAcc, infos: list[SiteInfo]) -> Span:
    def key(s: int) -> tuple[int, int]:
        return (acc.seq.get(s, 1 << 30), s)

    order = sorted({acc.start, *acc.sites, *acc.ends}, key=key)
    ends = [infos[e].name for e in sorted(acc.ends, key=key)]
    return Span(
        start=infos[acc.start].name,
        end=None if acc.reaches_output or not ends else ends[0],
        peak=acc.peak,
        peak_site=infos[acc.peak_site].name,
        sites=[infos[s].name for s in order],
        ends=ends,
        reaches_output=acc.reaches_output,
        batches=acc.batches,
        first_batch=acc.first_batch,
        fused=acc.fused,
    )


def _span_finding(span: Span, start_op: str, threshold: float, in_fp16: bool = False) -> Finding:
    where = "the model output" if span.end is None else ", ".join(span.ends[:3])
    if (not math.isfinite(span.peak) and not math.isinf(span.peak)) or math.isinf(span.peak):
        kind, detail = (
            FindingKind.NONFINITE,
            (
                f"{span.start} produces inf/NaN where the forward computes in float16 (FP16's "
                "own overflow, not the FP32 values; see the fp16-inside note)"
                if in_fp16
                else f"{span.start} produces inf/NaN already in FP32; the model itself is broken there"
            ),
        )
    elif start_op == "exp":
        kind, detail = (
            FindingKind.SOFTMAX_EXP,
            (
                f"exp overflows FP16 for arguments above {LN_FP16_MAX:.2f} (peak {span.peak:.3g}); "
                "subtract the row max first: torch.softmax does, and TensorRT's Softmax is stable"
            ),
        )
    else:
        kind, detail = (
            FindingKind.OVERFLOW,
            (
                f"values leave FP16 range at {span.start} (peak {span.peak:.3g} at "
                f"{span.peak_site}, {span.peak / threshold:.1f}x the limit) and return at {where}"
            ),
        )
    if span.fused:
        detail += (
            "; TensorRT fuses this conv/linear with the op that brings it back, so the "
            "value is stored in FP16 only where that fusion does not happen"
        )
    return Finding(
        site=span.start,
        mechanism=Mechanism.OUTPUT,
        kind=kind,
        peak=span.peak,
        detail=detail,
        batch=span.first_batch,
    )


def build_report(
    acc: Accumulator,
    infos: list[SiteInfo],
    params: list[ParamCheck],
    model: torch.nn.Module | None,
    threshold: float,
    *,
    source: tuple[str, dict[str, list[float]]] | None = None,
) -> Report:
    """The report; ``source`` (model class, weight fingerprint) stands in for ``model``
    when there is no torch module (an ONNX graph)."""
    counts = acc.counts()
    sites = {
        infos[s].name: _site_stats(infos[s], a, counts[s]) for s, a in sorted(acc.sites.items())
    }
    # in the order they first overflowed: a module reused in a loop may overflow late
    in_time = sorted(acc.spans.values(), key=lambda a: (a.first_seen, a.start))
    spans = [_span(a, infos) for a in in_time]
    findings = [
        _span_finding(s, infos[a.start].op, threshold, a.start in acc.fp16)
        for s, a in zip(spans, in_time)
    ]
    for (sid, kind), ia in sorted(acc.internal.items()):
        findings.append(
            Finding(
                site=infos[sid].name,
                mechanism=Mechanism.INTERNAL,
                kind=kind,
                peak=ia.peak,
                batch=ia.batch,
                detail=_internal.describe(kind, ia.peak, ia.ctx, threshold),
                tensor=ia.ctx.get("norm") or ia.ctx.get("op", ""),
            )
        )
    findings.extend(underflow_findings(acc.underflow, infos))
    edges = sorted((infos[a].name, infos[b].name) for a, b in acc.edges)
    findings.extend(judge(params, sites, edges))
    for sid, a in sorted(acc.sites.items()):
        if a.saturated and sid not in acc.fp16:  # float16's inf is its overflow, not a mask
            findings.append(
                Finding(
                    site=infos[sid].name,
                    mechanism=Mechanism.NOTE,
                    kind=FindingKind.MASK_CONSTANT,
                    peak=math.inf,
                    count=a.saturated,
                    detail=(
                        f"{a.saturated} values at |v| >= 1e30 (a masking constant such as "
                        "torch.finfo(torch.float32).min, or inf): a model cast with .half() picks "
                        "finfo(float16).min instead, but an FP32 graph converted to FP16 turns the "
                        "constant into inf (NaN where it meets a 0); use -65504 or masked_fill"
                    ),
                )
            )
    by_module: dict[str, list[int]] = {}
    for sid in sorted(acc.upcast):
        by_module.setdefault(infos[sid].module, []).append(sid)
    for sids in by_module.values():
        worst = max(sids, key=lambda s: acc.upcast[s][0])
        peak, batch = acc.upcast[worst]
        names = ", ".join(infos[s].name for s in sids[:4]) + (", ..." if len(sids) > 4 else "")
        findings.append(
            Finding(
                site=infos[sids[0]].name,
                mechanism=Mechanism.NOTE,
                kind=FindingKind.FP32_UPCAST,
                peak=peak,
                batch=batch,
                count=len(sids),
                detail=(
                    f"{names}: values up to {peak:.3g} > {threshold:g}, computed in FP32 by a .half() "
                    "model (its own upcast, or an FP32 tensor made in forward), so no FP16 overflow "
                    "there; an FP16 graph converted from the FP32 export has no such upcast"
                ),
            )
        )
    if acc.fp16:
        first = sorted(acc.fp16, key=lambda sid: (acc.fp16[sid], sid))
        names = ", ".join(infos[sid].name for sid in first[:4]) + (
            ", ..." if len(first) > 4 else ""
        )
        findings.append(
            Finding(
                site=infos[first[0]].name,
                mechanism=Mechanism.NOTE,
                kind=FindingKind.FP16_INSIDE,
                peak=0.0,
                batch=acc.fp16[first[0]],
                count=len(first),
                detail=(
                    f"{len(first)} site(s) of this FP32 model computed in float16 ({names}): "
                    "torch.autocast inside its forward, or a .half() there; their values are "
                    "FP16's own (inf where FP16 overflowed), not how far FP32 goes"
                ),
            )
        )
    for k, inp in sorted(acc.inputs.items()):
        what = "inf/NaN" if inp.nonfinite else f"values up to {inp.peak:.3g}"
        findings.append(
            Finding(
                site=f"input[{k}]",
                mechanism=Mechanism.INPUT,
                kind=FindingKind.NONFINITE if inp.nonfinite else FindingKind.OVERFLOW,
                peak=inp.peak,
                batch=inp.batch,
                count=inp.nonfinite,
                tensor=inp.name,  # its keyword or graph input name, or its position
                detail=f"{INPUT_WORDS}{input_label(k, inp.name)} holds {what} (batch {inp.batch}): a "
                "problem of the data, not of the model; FP16 inputs cannot carry it",
            )
        )
    name, weights = source if source is not None else (model_class(model), fingerprint(model))
    meta = ReportMeta(
        model_class=name,
        batches=acc.batches,
        torch_version=torch.__version__,
        fp16lens_version=__version__,
        threshold=threshold,
        input_shapes=acc.input_shapes,
        weights=weights,
        inputs=acc.input_specs,
    )
    return Report(sites=sites, spans=spans, findings=findings, edges=edges, meta=meta)
