"""Whether a parameter's loss in FP16 (subnormal rounding, flush to 0) is visible.

The rule, per finding, against the values the parameter joins (the outputs of its module's
sites, at their typical magnitude m: the lower edge of the median binade of |y|):

- a bias (added): harmless when the largest lost value is at most half the FP16 step at m
  (``half_step(m)``); then FP16 stores the same output with or without it. A flushed bias
  (|b| < 2^-25) always passes unless the values it joins are themselves 0.
- a weight (multiplied): the output of one channel changes by at most
  (sum of its lost |w|) × (peak |input|); harmless when that is at most ``half_step(m)``, or
  when the lost |w| of every channel is at most 2^-11 of that channel's sum of |w| (no more
  than the rounding FP16 applies to its other weights anyway).

A guard (an eps or a clip bound: every value positive and added, or a Max/Clip bound) is
harmless only when the values it joins never flush: where at least ``GUARD_SHARE`` of them
(at its site, or at a producer feeding it) are below 2^-24 and they go on to an op where 0
is singular (a log, a divide, an rsqrt, a negative power: ``_core.underflow.is_singular_name``, within
``_REACH`` sites), FP16 makes those values 0 and the vanished guard no longer keeps them
off 0 (``watch/onnx/_underflow.py`` checks that op itself). Read by a Conv, the flush is
harmless.

Anything else, or a module with no recorded values, stays a problem. Overflow always does.
"""

from __future__ import annotations

import dataclasses

from fp16lens._core import half_step
from fp16lens._core.flush import REL_STEP, percent
from fp16lens._core.sites import Mechanism
from fp16lens._core.underflow import is_singular_name
from fp16lens.report import Finding, SiteStats
from fp16lens.watch._params import ParamCheck

GUARD_SHARE = 2.0**-10
"""Share of values below 2^-24 that makes a vanished guard visible: values that cross 0
(a conv output) have far fewer, a square or an exp of a quiet signal far more."""


_REACH = 3


def _reaches_singular(
    names: set[str], edges: list[tuple[str, str]], sites: dict[str, SiteStats]
) -> str | None:
    """A site with a singular op within ``_REACH`` edges downstream of ``names``."""
    front = set(names)
    for _ in range(_REACH):
        front = {c for p, c in edges if p in front and c in sites}
        hit = next((c for c in sorted(front) if is_singular_name(sites[c].op)), None)
        if hit is not None:
            return hit
    return None


def _flushing(
    joined: list[SiteStats], edges: list[tuple[str, str]], sites: dict[str, SiteStats]
) -> SiteStats | None:
    """The producer feeding ``joined`` (or a joined site itself) with the largest share of
    values below 2^-24, when that share reaches ``GUARD_SHARE``."""
    names = {s.name for s in joined}
    near = [sites[p] for p, c in edges if c in names and p in sites and p not in names]
    best = max([*near, *joined], key=lambda s: s.underflow_share, default=None)
    return best if best is not None and best.underflow_share >= GUARD_SHARE else None


def _joined(module: str, sites: dict[str, SiteStats]) -> list[SiteStats]:
    """The sites whose values the module's parameters join (with values recorded)."""
    return [s for s in sites.values() if s.module == module and s.numel > s.zeros]


def _input_peak(
    joined: list[SiteStats], edges: list[tuple[str, str]], sites: dict[str, SiteStats]
) -> float | None:
    names = {s.name for s in joined}
    peaks = [sites[p].absmax for p, c in edges if c in names and p in sites]
    return max(peaks) if peaks else None


GUARD_FIX = (
    "keep {start} through {end} in FP32 (fp16lens.patch makes them an FP32 island), or "
    "use a guard FP16 holds (an eps of at least 6.1e-05)"
)


def _guard(
    check: ParamCheck, sites: dict[str, SiteStats], edges: list[tuple[str, str]]
) -> tuple[str, str] | None:
    """(why, fix) when ``check`` is a vanished guard whose joined values flush and reach a
    singular op; None otherwise."""
    joined = _joined(check.finding.site, sites) if check.guard else []
    flushing = _flushing(joined, edges, sites) if joined else None
    singular = _reaches_singular({s.name for s in joined}, edges, sites) if flushing else None
    if singular is None or flushing is None:  # (no singular op without flushing values)
        return None
    return (
        f"visible: the values it joins flush too ({percent(flushing.underflow_share)} of "
        f"{flushing.name}'s values are below 2^-24 and become 0 in FP16), and without it "
        f"nothing keeps them off 0 where they reach {sites[singular].op} {singular}",
        GUARD_FIX.format(start=flushing.name, end=singular),
    )


def _verdict(
    check: ParamCheck, sites: dict[str, SiteStats], edges: list[tuple[str, str]]
) -> tuple[bool, str]:
    loss = check.loss
    assert loss is not None  # judge words an overflow (no loss) before this
    joined = _joined(check.finding.site, sites)
    if check.additive:
        if not joined:
            return False, "not judged: no recorded values of the module it joins"
        site = min(joined, key=lambda s: s.quantile_low(0.5))
        m = site.quantile_low(0.5)
        change, what = loss.value, f"a change of ≤ {loss.value:.2g} per value"
    else:
        if loss.rel <= REL_STEP:
            return True, (
                f"harmless: each output channel loses ≤ {loss.rel:.2g} of its weight "
                f"magnitude, below the FP16 rounding of its other weights (2^-11)"
            )
        peak_in = _input_peak(joined, edges, sites) if joined else None
        if peak_in is None:
            return False, (
                f"each output channel loses up to {percent(loss.rel)} of its weight magnitude; "
                "the module's input was not recorded, so it cannot be judged harmless"
            )
        site = min(joined, key=lambda s: s.quantile_low(0.5))
        m = site.quantile_low(0.5)
        change = loss.slice * peak_in
        what = (
            f"a change of ≤ {change:.2g} per value ({loss.slice:.2g} lost × input ≤ {peak_in:.3g})"
        )
    step = half_step(m)
    where = f"the values it joins at {site.name} (typical |y| ≈ {m:.2g})"
    if change <= step:
        return True, f"harmless: {what}, below half an FP16 step ({step:.2g}) of {where}"
    return False, f"visible: {what}, above half an FP16 step ({step:.2g}) of {where}"


def judge(
    checks: list[ParamCheck], sites: dict[str, SiteStats], edges: list[tuple[str, str]]
) -> list[Finding]:
    """The findings of ``checks``: a harmless loss becomes a note, with the reason."""
    out = []
    for check in checks:
        if check.loss is None:
            out.append(check.finding)
            continue
        guard = _guard(check, sites, edges)
        harmless, why = (False, guard[0]) if guard else _verdict(check, sites, edges)
        out.append(
            dataclasses.replace(
                check.finding,
                mechanism=Mechanism.NOTE if harmless else Mechanism.PARAMETER,
                detail=f"{check.finding.detail}; {why}",
                fix=guard[1] if guard else check.finding.fix,
            )
        )
    return out
