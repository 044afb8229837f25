"""Reduce each forward call's events into per-site statistics, spans and findings.

Everything kept here is O(number of sites): plain Python numbers, merged over
batches (and over ranks by ``_distributed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fp16lens._trace import MATMUL_LIKE
from fp16lens.report import HIST_BINS, HIST_MIN_EXP, SATURATED
from fp16lens.watch._inputs import merge_inputs
from fp16lens.watch._recorder import INPUT_SITE, Forward, SiteInfo
from fp16lens.watch._spans import find_spans
from fp16lens.watch._tensorstats import (
    S_NONFINITE,
    S_OVER,
    S_ZEROS,
    SAMPLE_LEN,
    reduce_samples,
    stack_extremes,
)
from fp16lens.watch._underflow import UnderflowAcc, add_forward

# histogram bins wholly below 2^-14 (subnormal in FP16) and below 2^-24 (become 0)
_SUBNORMAL_BINS = -14 - HIST_MIN_EXP + 1
_UNDERFLOW_BINS = -24 - HIST_MIN_EXP + 1


def _gt(a: float, b: float) -> bool:
    """a > b where NaN counts as the largest value."""
    return (not math.isnan(b)) and (math.isnan(a) or a > b)


def _maxes(extremes: list) -> tuple[list[float], list[int]]:
    """max |v| per event from (min, max) pairs: tensors (one sync) or Python floats; and
    the events whose pair was a tensor (reduced off the CPU without a host sync)."""
    device = [e for e, x in enumerate(extremes) if torch.is_tensor(x[0])]
    flat = (
        iter(stack_extremes([extremes[e] for e in device]).cpu().tolist()) if device else iter(())
    )
    out = []
    for e in extremes:
        lo, hi = next(flat) if torch.is_tensor(e[0]) else e
        out.append(hi if hi >= -lo else -lo)  # NaN stays NaN
    return out, device


def _saturated_from_samples(fw: Forward, maxes: list[float], device: list[int]) -> None:
    """Off the CPU an op's extremes are reduced without a host sync, so no exact pass finds
    masking constants (|v| >= SATURATED, such as finfo(float32).min) beside its values.
    Where such an event's peak is saturated, its sample tells the values beside them
    (their largest, and the share of constants), as the CPU path's exact pass would."""
    for e in device:
        if not maxes[e] >= SATURATED or e in fw.saturated:
            continue  # (a NaN peak is not saturated)
        a = fw.samples[e].abs()
        huge = a >= SATURATED
        below = float(torch.where(huge, 0, a).max()) if a.numel() else 0.0
        share = float(huge.float().mean()) if a.numel() else 1.0
        fw.saturated[e] = (below, max(1, round(share * fw.numels[e])))


@dataclass
class SiteAcc:
    """Per-site numbers kept in Python; the sampled counts (histogram, zeros, non-finite,
    overflow) live in one row of ``Accumulator.table``, accumulated in one op per call."""

    calls: int = 0
    absmax: float = 0.0
    absmax_batch: int = -1
    numel: int = 0
    saturated: int = 0
    shape: list[int] = field(default_factory=list)


@dataclass
class SiteCounts:
    """Estimated counts of one site over all calls (scaled up from the samples)."""

    hist: list[float]
    zeros: float
    nonfinite: float
    overflow: float

    @property
    def subnormal(self) -> float:
        return sum(self.hist[:_SUBNORMAL_BINS])

    @property
    def underflow(self) -> float:
        return sum(self.hist[:_UNDERFLOW_BINS])


@dataclass
class SpanAcc:
    start: int
    sites: set[int] = field(default_factory=set)
    ends: set[int] = field(default_factory=set)
    peak: float = 0.0
    peak_site: int = -1
    reaches_output: bool = False
    batches: int = 0
    first_batch: int = -1
    fused: bool = True
    seq: dict[int, int] = field(default_factory=dict)  # site -> first event index seen
    first_seen: tuple[int, int] = (-1, -1)  # (forward, event index) of its first start: time order


@dataclass
class InternalAcc:
    peak: float
    batch: int
    ctx: dict


@dataclass
class InputAcc:
    index: int  # position of the tensor among the flattened inputs
    peak: float
    batch: int
    nonfinite: int
    name: str = ""  # the argument it came in: a keyword, an ONNX graph input ("" unknown)


@dataclass
class Accumulator:
    threshold: float
    sites_info: list[SiteInfo]
    sites: dict[int, SiteAcc] = field(default_factory=dict)
    spans: dict[int, SpanAcc] = field(default_factory=dict)  # by start site id
    internal: dict[tuple[int, str], InternalAcc] = field(default_factory=dict)
    inputs: dict[int, InputAcc] = field(default_factory=dict)
    # sites a .half() model computes in FP32 whose values pass the threshold: (peak, batch)
    upcast: dict[int, tuple[float, int]] = field(default_factory=dict)
    # site -> first batch where an FP32 model computed it in float16 (Forward.fp16)
    fp16: dict[int, int] = field(default_factory=dict)
    edges: set[tuple[int, int]] = field(default_factory=set)
    # singular sites that FP16's zeros make non-finite (watch/_underflow.py)
    underflow: dict[int, UnderflowAcc] = field(default_factory=dict)
    batches: int = 0
    input_shapes: list[list[list[int]]] = field(default_factory=list)
    input_specs: list[dict] = field(default_factory=list)  # per input: dtype, shape, min, max
    # per site: HIST_BINS binade counts, zeros, non-finite, overflow (float64, on the CPU)
    table: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, SAMPLE_LEN, dtype=torch.float64)
    )
    # marks the events of a forward that a .half() model computes in FP32, where the
    # recorder did not know them yet (Recorder.half_dtypes_of); called only for a forward
    # with a value out of range, the only place where it changes anything
    half_dtypes: Callable[[Forward], None] | None = None

    def counts(self) -> dict[int, SiteCounts]:
        rows = self.table.tolist()
        return {
            sid: SiteCounts(r[:HIST_BINS], r[S_ZEROS], r[S_NONFINITE], r[S_OVER])
            for sid, r in ((s, rows[s]) for s in self.sites)
        }

    def add(self, fw: Forward) -> None:
        self.batches += 1
        if fw.input_shapes not in self.input_shapes:
            self.input_shapes.append(fw.input_shapes)
        self.input_specs = merge_inputs(self.input_specs, fw.input_specs)
        if not fw.sites:
            return
        maxes, device = _maxes(fw.extremes)
        _saturated_from_samples(fw, maxes, device)
        for e, (below, _) in fw.saturated.items():
            # an inf input is bad data, and an inf computed in float16 is FP16's overflow:
            # neither is a masking constant
            if fw.sites[e] != INPUT_SITE and e not in fw.fp16:
                maxes[e] = below
        rows = reduce_samples(fw.samples, self.threshold)
        add_forward(self.underflow, fw.flush, fw.consts, fw, rows, INPUT_SITE, self.half_dtypes)
        # NaN counts as out of range, unless the inputs already carry NaN/inf: then
        # what follows is the data's problem (reported as such), not the model's, and
        # each op is judged by its finite values (its own overflow is still found)
        bad_input = any(
            not math.isfinite(maxes[e]) for e, s in enumerate(fw.sites) if s == INPUT_SITE
        )
        if bad_input:
            for e, finite in fw.finite_max.items():
                if fw.sites[e] != INPUT_SITE:
                    maxes[e] = finite
        oor = [m > self.threshold if bad_input else not m <= self.threshold for m in maxes]
        peaks = self._internal_peaks(fw, bad_input)
        if self.half_dtypes is not None and (
            any(p is not None for p in peaks)
            or any(o and s != INPUT_SITE for o, s in zip(oor, fw.sites))
        ):
            self.half_dtypes(fw)
        for e in fw.half_fp32:
            if oor[e] and math.isfinite(maxes[e]):
                sid = fw.sites[e]
                if _gt(maxes[e], self.upcast.get(sid, (0.0, -1))[0]):
                    self.upcast[sid] = (maxes[e], fw.index)
        for e in fw.fp32:
            oor[e] = False
        for e in fw.fp16:
            self.fp16.setdefault(fw.sites[e], fw.index)
        self._add_sites(fw, maxes, rows)
        self._add_inputs(fw, maxes, rows)
        self._add_edges(fw)
        self._add_spans(fw, maxes, oor)
        self._add_internal(fw, peaks)

    def _add_sites(self, fw: Forward, maxes, rows: torch.Tensor) -> None:
        rows = rows.to("cpu", torch.float64)
        sampled = rows[:, :S_OVER].sum(dim=1)
        numels = torch.tensor(fw.numels, dtype=torch.float64)
        rows *= torch.where(sampled > 0, numels / sampled, 0.0).unsqueeze(1)
        for e, n in fw.exact_over.items():
            rows[e, S_OVER] = n
        keep = [e for e, sid in enumerate(fw.sites) if sid != INPUT_SITE]
        if not keep:
            return
        sids = torch.tensor([fw.sites[e] for e in keep])
        if len(self.sites_info) > self.table.shape[0]:
            grown = torch.zeros(
                max(len(self.sites_info), 2 * self.table.shape[0]), SAMPLE_LEN, dtype=torch.float64
            )
            grown[: self.table.shape[0]] = self.table
            self.table = grown
        self.table.index_add_(0, sids, rows[keep] if len(keep) < len(fw.sites) else rows)
        sites, index = self.sites, fw.index
        for e in keep:
            sid = fw.sites[e]
            acc = sites.get(sid)
            if acc is None:
                acc = sites[sid] = SiteAcc(shape=list(fw.shapes[e]))
            acc.calls += 1
            acc.numel += fw.numels[e]
            m = maxes[e]
            if _gt(m, acc.absmax) or acc.absmax_batch < 0:
                acc.absmax, acc.absmax_batch = m, index
        for e, (_, n) in fw.saturated.items():
            if fw.sites[e] != INPUT_SITE:
                sites[fw.sites[e]].saturated += n

    def _add_inputs(self, fw: Forward, maxes, rows: torch.Tensor) -> None:
        k = 0
        for e, sid in enumerate(fw.sites):
            if sid != INPUT_SITE:
                continue
            if not maxes[e] <= self.threshold:
                cur = self.inputs.get(k)
                bad = int(rows[e, S_NONFINITE] > 0 or math.isnan(maxes[e]) or math.isinf(maxes[e]))
                if cur is None or _gt(maxes[e], cur.peak):
                    name = fw.input_names[k] if k < len(fw.input_names) else ""
                    self.inputs[k] = InputAcc(k, maxes[e], fw.index, bad, name)
            k += 1

    def _add_edges(self, fw: Forward) -> None:
        for e, sid in enumerate(fw.sites):
            if sid == INPUT_SITE:
                continue
            for p in fw.inputs[e]:
                psid = fw.sites[p]
                if psid != INPUT_SITE and psid != sid:
                    self.edges.add((psid, sid))

    def _add_spans(self, fw: Forward, maxes, oor) -> None:
        is_input = [s == INPUT_SITE for s in fw.sites]
        for fs in find_spans(oor, fw.inputs, is_input, fw.outputs):
            first = min(fs.starts) if fs.starts else fs.members[0]
            start = fw.sites[first]
            acc = self.spans.setdefault(start, SpanAcc(start=start))
            acc.batches += 1
            if acc.first_batch < 0:
                acc.first_batch = fw.index
                acc.first_seen = (fw.index, first)
            acc.sites.update(fw.sites[m] for m in fs.members)
            acc.ends.update(fw.sites[e] for e in fs.ends)
            for e in (*fs.members, *fs.ends):
                acc.seq.setdefault(fw.sites[e], e)
            acc.reaches_output |= fs.reaches_output
            for m in fs.members:
                if _gt(maxes[m], acc.peak) or acc.peak_site < 0:
                    acc.peak, acc.peak_site = maxes[m], fw.sites[m]
            acc.fused &= self._fused(fs, fw)

    def _fused(self, fs, fw: Forward) -> bool:
        """Only a conv/linear output that the following BN/ReLU brings back: TensorRT
        fuses them into one kernel, so the out-of-range value is never stored."""
        ops = self.sites_info
        members_ok = all(
            ops[fw.sites[m]].op in MATMUL_LIKE
            or ops[fw.sites[m]].op in ("Conv1d", "Conv2d", "Conv3d", "Linear")
            for m in fs.members
        )
        ends_ok = bool(fs.ends) and all(
            ops[fw.sites[e]].op
            in ("batch_norm", "relu", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "ReLU")
            for e in fs.ends
        )
        return members_ok and ends_ok and not fs.reaches_output

    def _internal_peaks(self, fw: Forward, bad_input: bool) -> list[float | None]:
        """The peak of each internal entry of ``fw`` that passes the threshold, else None."""
        if not fw.internal:
            return []
        peaks = torch.stack([p.float().cpu() for _, _, p, _ in fw.internal]).tolist()
        return [
            p if p > self.threshold or (not bad_input and math.isnan(p)) else None for p in peaks
        ]

    def _add_internal(self, fw: Forward, peaks: list[float | None]) -> None:
        for i, ((sid, kind, _, ctx), peak) in enumerate(zip(fw.internal, peaks)):
            if peak is not None and not (
                fw.half_fp32 and fw.internal_of and fw.internal_of[i] in fw.half_fp32
            ):
                key = (sid, kind)
                cur = self.internal.get(key)
                if cur is None or _gt(peak, cur.peak):
                    self.internal[key] = InternalAcc(peak, fw.index, ctx)
