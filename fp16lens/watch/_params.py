"""Parameters and buffers that FP16 cannot hold: beyond 65504, subnormal, flushed to 0.

Overflow is always a problem (.half() makes the value inf). A value that becomes subnormal
or 0 is judged by what its loss does to the values the parameter joins (``judge``): it is a
problem only where the change is visible at the FP16 precision of those values, else a note.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp16lens._core import FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL
from fp16lens._core.flush import FlushLoss, flush_loss
from fp16lens._core.sites import FindingKind, Mechanism
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


def _owner(name: str) -> tuple[str, str]:
    module, _, tensor = name.rpartition(".")
    return module, tensor


def _overflow(name: str, t: torch.Tensor, a: torch.Tensor, threshold: float) -> Finding | None:
    peak = float(a.max())
    if peak <= threshold:
        return None
    module, tensor = _owner(name)
    over = int((a > threshold).sum()) + int(a.isnan().sum())
    return Finding(
        site=module, mechanism=Mechanism.PARAMETER, kind=FindingKind.PARAM_OVERFLOW, peak=peak,
        tensor=tensor, count=over,
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
        kind, count, what = FindingKind.PARAM_UNDERFLOW, under, (
            f"are below 2^-24 and become 0 in FP16 ({under_mass:.0%} of the tensor's magnitude)"
        )
    elif sub and sub_mass >= options.param_subnormal_share:
        kind, count, what = FindingKind.PARAM_SUBNORMAL, sub, (
            f"are subnormal in FP16 (< 2^-14, {sub_mass:.0%} of the tensor's magnitude) and "
            "lose precision"
        )
    else:
        return None
    return Finding(
        site=module, mechanism=Mechanism.PARAMETER, kind=kind, peak=smallest, tensor=tensor, count=count,
        detail=f"{name}: {count} of {nz} non-zero values {what}",
    )


@torch.no_grad()
def check_parameters(model: torch.nn.Module, options: WatchOptions) -> list[ParamCheck]:
    """One check per problem per parameter/buffer tensor, with counts and FP16 loss."""
    checks: list[ParamCheck] = []
    named = list(model.named_parameters(remove_duplicate=True)) + list(
        model.named_buffers(remove_duplicate=True)
    )
    for name, t in named:
        if not torch.is_tensor(t) or not t.is_floating_point() or t.numel() == 0:
            continue
        a = t.detach().abs()
        over = _overflow(name, t, a, options.threshold)
        if over is not None:
            checks.append(ParamCheck(over))
        if _owner(name)[1] in _FOLDED_STATS:
            continue
        small = _small(name, a.float(), options)
        if small is not None:
            checks.append(ParamCheck(small, name.endswith("bias"), flush_loss(t)))
    return checks
