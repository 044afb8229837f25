"""Plant an FP16 overflow into a copy of a real architecture, the way training can:
scale one layer's affine weight so its output exceeds 65504, then let every later
batch norm see (and normalize) the larger values, as a trained net's statistics would.
For norm-free transformers, scale a Linear that feeds a LayerNorm (scale-invariant)."""

from __future__ import annotations

import copy

import torch
from torch import nn

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@torch.no_grad()
def _absmax_out(model, inputs, module) -> float:
    seen = []
    h = module.register_forward_hook(lambda m, a, o: seen.append(float(o.abs().max())))
    try:
        model(*inputs)
    finally:
        h.remove()
    return max(seen) if seen else 0.0


@torch.no_grad()
def plant_overflow(model: nn.Module, inputs: tuple, target: float = 4 * 65504.0):
    """A copy of ``model`` whose chosen layer outputs about ``target``; None if no place."""
    m = copy.deepcopy(model).eval()
    bns = [mod for mod in m.modules() if isinstance(mod, _BN) and mod.affine]
    if bns:
        bn = bns[int(len(bns) * 0.6)]
        peak = _absmax_out(m, inputs, bn)
        if peak <= 0:
            return None
        bn.weight.mul_(target / peak)
        bn.bias.mul_(target / peak)
        later = bns[bns.index(bn) + 1:]
        for b in later:
            b.reset_running_stats()
            b.momentum = None
            b.train()
        m(*inputs)
        for b in later:
            b.momentum = 0.1
        m.eval()
        return m
    names = [n for n, _ in m.named_modules()]
    mods = dict(m.named_modules())
    for name in names[: int(len(names) * 0.8)][::-1]:
        mod = mods[name]
        nxt = [mods[n] for n in names[names.index(name) + 1: names.index(name) + 4]]
        if isinstance(mod, nn.Linear) and any(isinstance(x, nn.LayerNorm) for x in nxt):
            peak = _absmax_out(m, inputs, mod)
            if peak <= 0:
                continue
            mod.weight.mul_(target / peak)
            if mod.bias is not None:
                mod.bias.mul_(target / peak)
            return m
    return None
