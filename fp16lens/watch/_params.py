"""Parameters and buffers that FP16 cannot hold: beyond 65504, subnormal, flushed to 0.

Overflow is always a problem (.half() makes a finite value inf; an inf or NaN it keeps as it
is, so those are no FP16 problem). A value that becomes subnormal
or 0 is judged by what its loss does to the values the parameter joins (``judge``): it is a
problem only where the change is visible at the FP16 precision of those values, else a note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp16lens._core import FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL
from fp16lens._core.flush import FlushLoss, flush_loss
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens._core.threads import on_threads
from fp16lens.report import Finding
from fp16lens.watch._options import WatchOptions

# Batch-norm statistics are folded into the conv in FP32 before deployment, and tiny values
# vanish next to eps anyway: flushing them is harmless (their overflow is not, see above).
_FOLDED_STATS = frozenset({"running_mean", "running_var"})


@dataclass(frozen=True)
class ParamCheck:
    """One finding about a parameter/buffer, with what its FP16 loss is for ``judge``."""

    finding: Finding
    additive: bool = False  # a bias: added to the values it joins, not multiplied
    loss: FlushLoss | None = None  # None: overflow, always a problem
    guard: bool = False  # an eps or a clip bound: keeps the values it joins off 0 (see _harm)


def _owner(name: str) -> tuple[str, str]:
    module, _, tensor = name.rpartition(".")
    return module, tensor


def _overflow(name: str, t: torch.Tensor, a: torch.Tensor, threshold: float) -> Finding | None:
    """Finite values beyond ``threshold``. An inf or NaN stays what it is in FP16 (a clip
    bound of -inf, as JAX exports write for max(x, -inf)): .half() changes nothing there."""
    if not bool(torch.isfinite(a).all()):
        a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    peak = float(a.max())
    if peak <= threshold:
        return None
    module, tensor = _owner(name)
    over = int((a > threshold).sum())
    return Finding(
        site=module,
        mechanism=Mechanism.PARAMETER,
        kind=FindingKind.PARAM_OVERFLOW,
        peak=peak,
        tensor=tensor,
        count=over,
        detail=(
            f"{name}: {over} of {t.numel()} values beyond FP16 "
            f"(max {peak:.3g} > {threshold:g}); .half() makes them inf"
        ),
    )


def _small(name: str, af: torch.Tensor, options: WatchOptions) -> Finding | None:
    """Values that become subnormal or 0, when they carry enough of the tensor's magnitude."""
    total = float(af.sum())
    if not total > 0:
        return None
    module, tensor = _owner(name)
    small = af < FP16_MIN_NORMAL
    sub_mass = float(torch.where(small, af, 0).sum()) / total
    if sub_mass < options.param_subnormal_share and sub_mass < options.param_underflow_share:
        return None  # the tiny values carry too little of the tensor to matter
    nz = int(torch.count_nonzero(af))
    sub = int(torch.count_nonzero(small & (af > 0)))
    tiny = af < FP16_MIN_SUBNORMAL
    under = int(torch.count_nonzero(tiny & (af > 0)))
    under_mass = float(torch.where(tiny, af, 0).sum()) / total
    smallest = float(torch.where(af > 0, af, torch.inf).min())
    if under and under_mass >= options.param_underflow_share:
        kind, count, what = (
            FindingKind.PARAM_UNDERFLOW,
            under,
            (f"are below 2^-24 and become 0 in FP16 ({under_mass:.0%} of the tensor's magnitude)"),
        )
    elif sub and sub_mass >= options.param_subnormal_share:
        kind, count, what = (
            FindingKind.PARAM_SUBNORMAL,
            sub,
            (
                f"are subnormal in FP16 (< 2^-14, {sub_mass:.0%} of the tensor's magnitude) and "
                "lose precision"
            ),
        )
    else:
        return None
    return Finding(
        site=module,
        mechanism=Mechanism.PARAMETER,
        kind=kind,
        peak=smallest,
        tensor=tensor,
        count=count,
        detail=f"{name}: {count} of {nz} non-zero values {what}",
    )


# One pass per tensor (a norm per chunk of _CHUNK values) rules out most problems before any
# exact pass runs: max |v| is at most the largest chunk's Σ|v|, and values below 2^-14 carry
# at most numel * 2^-14 of the magnitude Σ|v|. A chunk's float32 sum is within
# _CHUNK * 2^-24 < 2^-10 of the exact one; the bounds allow for that, and the share bound
# must clear the options' shares by a factor _MARGIN (the exact pass rounds too).
_CHUNK = 4096
_SLACK = 2.0**-10
_MARGIN = 1.25


def _screen(t: torch.Tensor, folded: bool) -> torch.Tensor:
    """[an upper bound of max |v|, a lower bound of Σ|v| (NaN when ``folded``)] of ``t``
    in float64, from one pass; batch-norm statistics get their exact max |v| instead."""
    v = t.detach().reshape(-1)
    if folded:
        lo, hi = torch.aminmax(v)
        nan = torch.full((), math.nan, dtype=torch.float64, device=v.device)
        return torch.stack([torch.maximum(-lo, hi).double(), nan])
    dtype = None if v.dtype in (torch.float32, torch.float64) else torch.float32
    full = v.numel() - v.numel() % _CHUNK
    tail = torch.linalg.vector_norm(v[full:], 1, dtype=dtype).double()
    peak, total = tail, tail
    if full:
        rows = torch.linalg.vector_norm(v[:full].view(-1, _CHUNK), 1, dim=1, dtype=dtype)
        peak = torch.maximum(rows.max().double(), tail)
        total = total + rows.sum(dtype=torch.float64)
    return torch.stack([peak * (1 + _SLACK), total * (1 - _SLACK)])


# Small float32 tensors (most of a model's: biases, norm weights, BN statistics) are read
# together, two multi-tensor norms for all of them, rather than a dozen ops each: their
# exact max |v|, and Σ|v| summed in float32, within _SLACK of exact for at most _SMALL values.
_SMALL = 1 << 14


def _screen_small(tensors: list[torch.Tensor], folded: list[bool]) -> torch.Tensor:
    """``_screen`` of many small float32 tensors on one device: (n, 2) float64."""
    peaks = torch.stack(torch._foreach_norm(tensors, math.inf)).double()
    l1 = torch.stack(torch._foreach_norm(tensors, 1)).double() * (1 - _SLACK)
    peaks[l1.isnan()] = math.nan  # a sum keeps NaN on every device; a max may not
    l1[torch.tensor(folded, device=l1.device)] = math.nan
    return torch.stack([peaks, l1], dim=1)


def _screens(named: list[tuple[str, torch.Tensor]], folded: list[bool]) -> list[list[float]]:
    """[bound of max |v|, bound of Σ|v|] per tensor, with one transfer to the host."""
    small: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        if t.dtype == torch.float32 and t.numel() <= _SMALL:
            small.setdefault(t.device, []).append(i)
    rows: list[torch.Tensor | None] = [None] * len(named)
    for at in small.values():
        got = _screen_small([named[i][1].detach() for i in at], [folded[i] for i in at])
        for i, row in zip(at, got.unbind(0)):
            rows[i] = row
    full = [
        r if r is not None else on_threads(_screen, t, f)
        for r, ((_, t), f) in zip(rows, zip(named, folded))
    ]
    same = len({r.device for r in full}) == 1  # one transfer, not one sync per tensor
    return (torch.stack(full).cpu() if same else torch.stack([r.cpu() for r in full])).tolist()


def _negligible(numel: int, l1: float, options: WatchOptions) -> bool:
    """Whether the values below 2^-14 cannot reach either share of the magnitude (or the
    tensor is all zeros, which ``_small`` passes by too)."""
    share = min(options.param_subnormal_share, options.param_underflow_share)
    return l1 == 0 or (
        l1 > 0 and math.isfinite(l1) and numel * FP16_MIN_NORMAL / l1 * _MARGIN < share
    )


@torch.no_grad()
def check_parameters(model: torch.nn.Module, options: WatchOptions) -> list[ParamCheck]:
    """One check per problem per parameter/buffer tensor, with counts and FP16 loss. Each
    tensor is read once (``_screen``); the exact passes run only where that does not rule a
    problem out."""
    checks: list[ParamCheck] = []
    named = list(model.named_parameters(remove_duplicate=True)) + list(
        model.named_buffers(remove_duplicate=True)
    )
    named = [(n, t) for n, t in named if torch.is_tensor(t) and t.is_floating_point() and t.numel()]
    if not named:
        return checks
    folded = [_owner(n)[1] in _FOLDED_STATS for n, _ in named]
    values = _screens(named, folded)
    for (name, t), skip_small, (peak, l1) in zip(named, folded, values):
        threshold = options.threshold
        if not peak <= threshold:  # (NaN included)
            over = _overflow(name, t, t.detach().abs(), threshold)
            if over is not None:
                checks.append(ParamCheck(over))
        if skip_small or _negligible(t.numel(), l1, options):
            continue
        small = _small(name, t.detach().abs().float(), options)
        if small is not None:
            additive = name.endswith("bias")
            guard = additive and bool((t.detach() > 0).all())
            checks.append(ParamCheck(small, additive, flush_loss(t), guard))
    return checks
