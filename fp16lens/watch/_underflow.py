"""Underflow that breaks (mechanism ``underflow``): where real FP16 holds a 0 that FP32
does not, and that 0 reaches an op singular at 0 (log, a denominator, rsqrt, a negative
power). See ``_core/underflow.py`` for the facts.

The recorder keeps, for the running forward only, a *zero shadow*: a boolean mask of
where a tensor is 0 in FP16 but maybe not in FP32. Most tensors need none: their FP16
zeros are their values at or below 2^-25 (``direct``), computed when a singular op or a
zero-propagating op reads them. A mask is kept only where FP32 lifts a value that FP16
flushed: a reduction whose every input flushes (a row of flushed exps sums to 0 in FP16
but to ~1e-7 in FP32), a sqrt of a flushed variance, and whatever such a mask flows
through (views, clamps whose bound flushes, products). Masks die with their tensors.

At a singular op, the number of operand values FP16 makes 0 (and the outputs they make
non-finite) are 0-d tensors on the operand's device, reduced with the forward's other
statistics: no host sync per op. After the forward, the sampled per-event histograms
name the site where the values flushed (the farthest producer upstream whose values
fall below 2^-24), and the constants (eps, clip bounds) that FP16 made 0 on the way.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass, field

import torch

from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens._core.underflow import (
    FLUSH,
    SINGULAR_ARG,
    SINGULAR_BOTH,
    ZERO_JOINING,
    ZERO_KEEPING,
    ZERO_REDUCING,
    advice,
    describe,
    flushes,
    singular_pow,
)
from fp16lens.report import HIST_BINS, HIST_MIN_EXP, Finding

RELEVANT = frozenset(SINGULAR_ARG) | ZERO_KEEPING | ZERO_REDUCING | ZERO_JOINING
_UNDERFLOW_BINS = -24 - HIST_MIN_EXP + 1  # histogram bins wholly below 2^-24
_WALK = 12  # how far upstream the origin of the zeros is looked for


def _number(a) -> float | None:
    """A Python number, or the value of a one-element CPU tensor (an eps buffer)."""
    if isinstance(a, bool):
        return None
    if isinstance(a, (int, float)):
        return float(a)
    if (
        isinstance(a, torch.Tensor)
        and a.numel() == 1
        and a.device.type == "cpu"
        and a.is_floating_point()
    ):
        return float(a)
    return None


@dataclass
class Candidate:
    """One singular op run in one forward: counts are 0-d tensors until reduced."""

    site: int
    op: str
    operand: tuple[int, ...]  # producer events of the singular operand
    flushed: torch.Tensor | int
    nonfinite: torch.Tensor | int
    numel: int


class ZeroShadow:
    """The per-forward zero shadow (see the module doc). ``producers(t)`` gives the
    events that made ``t`` (empty for a parameter), ``fp32`` the events not stored in FP16."""

    def __init__(self, producers, fp32_events, static=lambda: False):
        self.static = static  # () -> whether the forward is being captured (no value reads)
        self.masks: dict[int, tuple] = {}  # id(t) -> (ref, mask, version)
        self.producers = producers
        self.fp32_events = fp32_events  # () -> set of events computed in FP32
        self.candidates: list[Candidate] = []
        self.consts: dict[int, str] = {}  # event -> the vanished constant it added/clamped to

    def reset(self) -> tuple[list[Candidate], dict[int, str]]:
        out = self.candidates, self.consts
        self.masks, self.candidates, self.consts = {}, [], {}
        return out

    # ---- masks -------------------------------------------------------------------------
    def _mask(self, t: torch.Tensor):
        ent = self.masks.get(id(t))
        if ent is None or ent[0]() is not t:
            return None
        if ent[2] >= 0:
            try:
                if t._version != ent[2]:
                    return None
            except RuntimeError:
                pass
        return ent[1]

    def _keep(self, t: torch.Tensor, mask: torch.Tensor, bump: int) -> None:
        if mask.shape != t.shape:
            try:
                mask = torch.broadcast_to(mask, t.shape)
            except RuntimeError:
                return
        try:
            version = t._version + bump
        except RuntimeError:  # an inference tensor: no version counter
            version = -1
        key = id(t)
        masks = self.masks

        def forget(r: weakref.ref, k: int = key, m: dict = masks) -> None:
            if m.get(k, (None,))[0] is r:
                m.pop(k, None)

        ref = weakref.ref(t, forget)
        masks[key] = (ref, mask, version)

    def _stored16(self, t: torch.Tensor, prods=None) -> bool:
        prods = self.producers(t) if prods is None else prods
        if not prods:
            return True  # a parameter or constant: stored in FP16 too
        fp32 = self.fp32_events()
        return not all(p in fp32 for p in prods)

    def zeros(self, t, prods=None, values=None) -> torch.Tensor | bool:
        """Where ``t`` is 0 in FP16 (a bool mask, or a bool for a number); ``prods`` and
        ``values`` stand in for its producers and values when an in-place op overwrote them."""
        if not isinstance(t, torch.Tensor):
            v = _number(t)
            return v is not None and (v == 0 or flushes(v))
        m = self._mask(t)
        if m is not None:
            return m
        v = (t if values is None else values).detach()
        if self._stored16(t, prods):
            return v.abs() <= FLUSH
        return v == 0

    def _own(self, out: torch.Tensor, fp32: bool):
        """The output's own FP16 zeros: its values that flush when stored."""
        return None if fp32 else out.detach().abs() <= FLUSH

    # ---- the recorder's hooks --------------------------------------------------------------
    def view(self, func, args, kwargs, out, bump: int) -> None:
        """A view/copy of a masked tensor carries the mask."""
        m = self._mask(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        if m is None or bump or not isinstance(out, torch.Tensor):
            return  # (an in-place view or copy_ into a masked tensor: the direct check stands)
        try:
            mo = func(m, *args[1:], **kwargs)
        except Exception:  # an op a bool mask does not take: the direct check stands
            return
        if (
            isinstance(mo, torch.Tensor) and mo.dtype == torch.bool and mo.shape == out.shape
        ):  # not a
            # dtype conversion (.half() of a mask is no mask)
            self._keep(out, mo, bump)

    def op(
        self,
        name: str,
        args,
        kwargs,
        out: torch.Tensor,
        site: int,
        eid: int,
        fp32: bool,
        bump: int,
        prods: tuple[int, ...],
    ) -> None:
        """One recorded op (``prods``: its producers, read before it ran; ``bump``: 1 when
        in place): propagate the shadow, note a vanished constant, and count the zeros
        reaching a singular op."""
        if name in SINGULAR_ARG:
            self._singular(name, args, out, site, prods if bump else None)
        if name in ("add", "sub", "clamp", "clamp_min", "maximum") and not fp32:
            self._const(name, args, kwargs, eid)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None:
            return
        z = None
        if name in ZERO_REDUCING:
            z = self._reduced(name, x, args, kwargs)
        elif name in ZERO_JOINING:
            other = args[1] if len(args) > 1 else kwargs.get("other")
            if self._mask(x) is not None or (
                isinstance(other, torch.Tensor) and self._mask(other) is not None
            ):
                zo = self.zeros(other)
                z = (
                    self.zeros(x) & zo
                    if isinstance(zo, torch.Tensor)
                    else (self.zeros(x) if zo else None)
                )
        elif name in ("clamp", "clamp_min"):
            lo = args[1] if len(args) > 1 else kwargs.get("min")
            v = _number(lo) if lo is not None else None
            if self._mask(x) is not None and (
                lo is None or (v is not None and (v <= 0 or flushes(v)))
            ):
                z = self._mask(x)
        elif name in ZERO_KEEPING and not (
            name == "pow" and len(args) > 1 and singular_pow(args[1])
        ):
            lifts = name == "sqrt" or (name == "pow" and _lifts(args))
            m = self._mask(x)
            if m is not None or lifts:
                z = self.zeros(x)
                if name == "mul" and len(args) > 1 and isinstance(args[1], torch.Tensor):
                    z = z | self.zeros(args[1])
        if z is None:
            return
        own = self._own(out, fp32)
        self._keep(out, z if own is None else z | own, bump)

    def _reduced(self, name: str, x: torch.Tensor, args, kwargs):
        at = 2 if name in ("linalg_vector_norm", "norm") else 1
        dim = args[at] if len(args) > at else kwargs.get("dim")
        keep = args[at + 1] if len(args) > at + 1 else kwargs.get("keepdim", False)
        if name in ("mean", "amax") and self._mask(x) is None:
            return None  # inputs all at or below 2^-25 give an output there too: its own
            # values tell (a sum or a norm of many flushed values rises above it in FP32)
        z = self.zeros(x)
        if not isinstance(z, torch.Tensor):
            return None
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            return z.all()
        dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
        return z.all(dim=dims, keepdim=bool(keep))

    def _const(self, name: str, args, kwargs, eid: int) -> None:
        if name in ("clamp", "clamp_min"):
            cs, what = [args[1] if len(args) > 1 else kwargs.get("min")], "clamp bound"
        elif name == "maximum":  # torch.max(torch.tensor(eps), x): either side
            cs, what = list(args[:2]), "eps"
        else:
            cs, what = [args[1] if len(args) > 1 else kwargs.get("other")], "eps"
        for c in cs:
            if isinstance(c, torch.Tensor) and self.producers(c):
                continue  # an activation, not a constant
            v = _number(c)
            if v is not None and flushes(v):
                self.consts[eid] = f"{what} {v:.3g}"

    def _singular(self, name: str, args, out: torch.Tensor, site: int, inplace) -> None:
        if name in SINGULAR_BOTH:
            self._both(name, args, out, site)
            return
        k = SINGULAR_ARG[name]
        if name == "pow" and not (len(args) > 1 and singular_pow(args[1])):
            return
        if len(args) <= k or not isinstance(args[k], torch.Tensor):
            return
        a = args[k]
        if not a.is_floating_point() or a.numel() == 0:
            return
        values = None
        if inplace is not None and k == 0:  # log_(x): x already holds the logs
            values = _operand(name, out.detach(), args)
            if values is None:
                return
        z = self.zeros(a, inplace if k == 0 else None, values)
        if not isinstance(z, torch.Tensor):
            return
        z = z & ((a.detach() if values is None else values) != 0)  # zeros of FP32 too make
        # FP32 non-finite: not FP16's doing
        flushed = z.sum()
        nonfinite = flushed if z.shape == out.shape else torch.broadcast_to(z, out.shape).sum()
        if a.device.type == "cpu" and not self.static():  # a sync is free: drop zero counts
            flushed, nonfinite = int(flushed), int(nonfinite)
            if not nonfinite:
                return
        operand = inplace if inplace is not None and k == 0 else self.producers(a)
        self.candidates.append(Candidate(site, name, tuple(operand), flushed, nonfinite, a.numel()))

    def _both(self, name: str, args, out: torch.Tensor, site: int) -> None:
        """atan2(y, x): wrong where FP16 makes both operands 0 and FP32 does not."""
        if len(args) < 2 or not all(
            isinstance(a, torch.Tensor) and a.is_floating_point() for a in args[:2]
        ):
            return
        y, x = args[0], args[1]
        zy, zx = self.zeros(y), self.zeros(x)
        if not (isinstance(zy, torch.Tensor) and isinstance(zx, torch.Tensor)):
            return
        try:
            z = torch.broadcast_to(zy & zx & ~((y.detach() == 0) & (x.detach() == 0)), out.shape)
        except RuntimeError:
            return
        flushed = nonfinite = z.sum()
        if out.device.type == "cpu" and not self.static():
            flushed = nonfinite = int(flushed)
            if not nonfinite:
                return
        operand = (*self.producers(y), *self.producers(x))
        self.candidates.append(
            Candidate(site, name, tuple(operand), flushed, nonfinite, out.numel())
        )


def _operand(name: str, out: torch.Tensor, args) -> torch.Tensor | None:
    """The operand of an in-place unary singular op, from its result."""
    if name == "log":
        return out.exp()
    if name == "log2":
        return torch.exp2(out)
    if name == "log10":
        return torch.pow(10.0, out)
    if name == "reciprocal":
        return out.reciprocal()
    if name == "rsqrt":
        return out.pow(-2)
    if name == "pow":
        return out.pow(1.0 / args[1])
    return None


def _lifts(args) -> bool:
    """pow(x, e) with 0 < e < 1 lifts a flushed x above the flush range in FP32."""
    e = args[1] if len(args) > 1 else None
    return isinstance(e, (int, float)) and 0 < e < 1


# ---- after the forward: the accumulator's side -----------------------------------------------


@dataclass
class UnderflowAcc:
    """One singular site over all batches."""

    op: str
    flushed: int = 0
    numel: int = 0
    nonfinite: int = 0
    batch: int = -1
    origins: dict[int, int] = field(default_factory=dict)  # site -> batches it was the origin
    consts: dict[str, int] = field(default_factory=dict)


def _origin(
    operand: tuple[int, ...],
    inputs,
    sites,
    share: list[float],
    consts: dict[int, str],
    input_site: int,
    flushed: float,
) -> tuple[int | None, list[str]]:
    """The farthest event upstream of ``operand`` in a chain of events whose values fall
    below 2^-24 (the site where the values flushed), and the vanished constants met.
    ``share``: per event, the sampled share of its non-zero values below 2^-24; a chain
    goes on while a producer flushes at least half the share of what it feeds (any
    tensor holds a few tiny values; the origin holds the many that matter)."""
    uf = [v >= 0.25 * flushed and v > 0 for v in share]
    seen: set[int] = set()
    frontier = list(operand)
    found: list[str] = []
    nearest = None
    for _ in range(_WALK):  # breadth first to the nearest flushing event
        nxt = []
        for e in frontier:
            if e in seen:
                continue
            seen.add(e)
            if e in consts:
                found.append(consts[e])
            if uf[e] and sites[e] != input_site and nearest is None:
                nearest = e
            nxt.extend(inputs[e])
        if nearest is not None or not nxt:
            break
        frontier = nxt
    origin = nearest
    if origin is None:
        return None, found
    for _ in range(4 * _WALK):  # up the chain while values flush
        for p in (origin, *inputs[origin]):
            if p in consts and consts[p] not in found:
                found.append(consts[p])
        ups = [
            p
            for p in inputs[origin]
            if share[p] >= 0.5 * share[origin] and share[p] > 0 and sites[p] != input_site
        ]
        if not ups:
            break
        origin = max(ups)  # the latest producer: the one this value was computed from
    return origin, found


def add_forward(
    acc: dict[int, UnderflowAcc],
    candidates: list[Candidate],
    consts: dict[int, str],
    fw,
    rows: torch.Tensor,
    input_site: int,
    half_dtypes=None,
) -> None:
    """Fold one forward's candidates into ``acc`` (one host sync for all of them).
    ``half_dtypes(fw)`` marks the events a .half() model computes in FP32 (its own
    upcasts), learnt once from a meta FP16 run: zeros whose values and operand a .half()
    model keeps in FP32 are not FP16's."""
    if not candidates:
        return
    tensors = [c for c in candidates if isinstance(c.flushed, torch.Tensor)]
    counts = {}
    if tensors:
        vals = torch.stack([torch.stack([c.flushed, c.nonfinite]) for c in tensors]).cpu().tolist()
        counts = {id(c): (int(f), int(n)) for c, (f, n) in zip(tensors, vals)}
    candidates = [
        dataclasses.replace(c, flushed=counts[id(c)][0], nonfinite=counts[id(c)][1])
        if id(c) in counts
        else c
        for c in candidates
    ]
    live = [c for c in candidates if c.nonfinite]
    if not live:
        return
    rows = rows[:, :HIST_BINS].to("cpu", torch.float64)
    share = (rows[:, :_UNDERFLOW_BINS].sum(dim=1) / rows.sum(dim=1).clamp(min=1)).tolist()
    if half_dtypes is not None:
        half_dtypes(fw)
    for c in live:
        origin, found = _origin(
            c.operand, fw.inputs, fw.sites, share, consts, input_site, c.flushed / max(c.numel, 1)
        )
        upcast = fw.half_fp32
        if (
            upcast
            and c.operand
            and all(p in upcast for p in c.operand)
            and (origin is None or origin in upcast)
        ):
            continue
        a = acc.setdefault(c.site, UnderflowAcc(op=c.op))
        a.flushed += c.flushed
        a.numel += c.numel
        a.nonfinite += c.nonfinite
        if a.batch < 0:
            a.batch = fw.index
        if origin is not None:
            o = fw.sites[origin]
            a.origins[o] = a.origins.get(o, 0) + 1
        for k in found:
            a.consts[k] = a.consts.get(k, 0) + 1


def findings(acc: dict[int, UnderflowAcc], infos) -> list[Finding]:
    """The report's underflow findings, one per singular site."""
    out = []
    for sid, a in sorted(acc.items()):
        site = infos[sid].name
        origin = infos[max(a.origins, key=lambda o: a.origins[o])].name if a.origins else ""
        const = max(a.consts, key=lambda c: a.consts[c]) if a.consts else ""
        share = a.flushed / a.numel if a.numel else 0.0
        out.append(
            Finding(
                site=site,
                mechanism=Mechanism.UNDERFLOW,
                kind=FindingKind.FLUSH_SINGULAR,
                peak=share if math.isfinite(share) else 1.0,
                batch=a.batch,
                tensor=origin or const,
                count=a.nonfinite,
                detail=describe(a.op, site, origin, const, share, a.nonfinite),
                fix=advice(a.op, origin, const),
            )
        )
    return out
