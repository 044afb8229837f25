"""Fp32Island: a module that runs in FP32 inside a model that is otherwise cast to half."""

from __future__ import annotations

import torch
from torch import nn


def _keep_fp32(fn):
    """Wrap an ``_apply`` function so FP32 tensors keep their dtype (and exact values)
    while device moves still happen: ``.half()`` leaves them FP32, ``.cuda()`` moves them."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if t.dtype == torch.float32 and out.is_floating_point() and out.dtype != torch.float32:
            return t.to(device=out.device)
        return out

    return apply


class Fp32Island(nn.Module):
    """Runs ``module`` in FP32: ``module(x.float() * in_scale) / out_scale`` cast back to the
    incoming dtype. The scales connect the island to rescaled regions on either side (the
    values inside may exceed FP16; the island's output is in range)."""

    fp16lens_fp32 = True  # watch and export may recognise an island by this attribute

    def __init__(self, module: nn.Module, in_scale: float = 1.0, out_scale: float = 1.0):
        super().__init__()
        self.module = module.float()
        self.in_scale = float(in_scale)
        self.out_scale = float(out_scale)
        self.train(module.training)

    def forward(self, *args, **kwargs):
        dtype = next(
            (a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), torch.float32
        )
        args = tuple(self._enter(a) for a in args)
        out = self.module(*args, **kwargs)
        if torch.is_tensor(out) and out.is_floating_point():
            if self.out_scale != 1.0:
                out = out / self.out_scale
            out = out.to(dtype)
        return out

    def _enter(self, a):
        if not (torch.is_tensor(a) and a.is_floating_point()):
            return a
        a = a.float()
        return a * self.in_scale if self.in_scale != 1.0 else a

    def __getattr__(self, name: str):
        """Attributes the model's own code reads from the wrapped module (``block.bn3.weight``,
        ``conv.out_channels``) pass through to it."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def _apply(self, fn, recurse=True):
        return super()._apply(_keep_fp32(fn), recurse)

    def extra_repr(self) -> str:
        return f"in_scale={self.in_scale:g}, out_scale={self.out_scale:g}"
