"""Parameters and buffers that FP16 cannot hold: beyond 65504, subnormal, flushed to 0."""

from __future__ import annotations

import torch

from fp16lens._core import FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL
from fp16lens.report._model import Finding
from fp16lens.watch._options import WatchOptions

# Batch-norm statistics are folded into the conv in FP32 before deployment, and tiny values
# vanish next to eps anyway: flushing them is harmless (their overflow is not, see above).
_FOLDED_STATS = frozenset({"running_mean", "running_var"})


def _owner(name: str) -> tuple[str, str]:
    module, _, tensor = name.rpartition(".")
    return module, tensor


@torch.no_grad()
def check_parameters(model: torch.nn.Module, options: WatchOptions) -> list[Finding]:
    """One finding per problem per parameter/buffer tensor, with counts."""
    findings: list[Finding] = []
    named = list(model.named_parameters(remove_duplicate=True)) + list(
        model.named_buffers(remove_duplicate=True)
    )
    for name, t in named:
        if not torch.is_tensor(t) or not t.is_floating_point() or t.numel() == 0:
            continue
        a = t.detach().abs()
        module, tensor = _owner(name)
        peak = float(a.max())
        if not peak <= options.threshold:
            over = int((a > options.threshold).sum()) + int(a.isnan().sum())
            findings.append(
                Finding(
                    site=module, mechanism="parameter", kind="param-overflow", peak=peak,
                    tensor=tensor, count=over,
                    detail=(
                        f"{name}: {over} of {t.numel()} values beyond FP16 "
                        f"(max {peak:.3g} > {options.threshold:g}); .half() makes them inf"
                    ),
                )
            )
        if tensor in _FOLDED_STATS:
            continue
        af = a.float()
        total = float(af.sum())
        if not total > 0:
            continue
        small = af < FP16_MIN_NORMAL
        sub_mass = float(torch.where(small, af, 0).sum()) / total
        if sub_mass < options.param_subnormal_share and sub_mass < options.param_underflow_share:
            continue  # the tiny values carry too little of the tensor to matter
        nz = int(torch.count_nonzero(af))
        sub = int(torch.count_nonzero(small & (af > 0)))
        tiny = af < FP16_MIN_SUBNORMAL
        under = int(torch.count_nonzero(tiny & (af > 0)))
        under_mass = float(torch.where(tiny, af, 0).sum()) / total
        smallest = float(torch.where(af > 0, af, torch.inf).min())
        if under and under_mass >= options.param_underflow_share:
            findings.append(
                Finding(
                    site=module, mechanism="parameter", kind="param-underflow", peak=smallest,
                    tensor=tensor, count=under,
                    detail=(
                        f"{name}: {under} of {nz} non-zero values are below 2^-24 and become 0 "
                        f"in FP16 ({under_mass:.0%} of the tensor's magnitude)"
                    ),
                )
            )
        elif sub and sub_mass >= options.param_subnormal_share:
            findings.append(
                Finding(
                    site=module, mechanism="parameter", kind="param-subnormal", peak=smallest,
                    tensor=tensor, count=sub,
                    detail=(
                        f"{name}: {sub} of {nz} non-zero values are subnormal in FP16 (< 2^-14, "
                        f"{sub_mass:.0%} of the tensor's magnitude) and lose precision"
                    ),
                )
            )
    return findings
