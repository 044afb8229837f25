"""The check after a rewrite: the patched model's FP32 outputs equal the original's."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fp16lens._core import PatchError
from fp16lens.report import Report

TOLERANCE = 1e-4
"""Relative to each output's largest |value|: rescaling by powers of two is exact, the
affine form of a batch norm rounds once (~1e-7); anything near 1e-4 is a wrong rewrite."""


@torch.no_grad()
def check_equivalent(original: nn.Module, patched: nn.Module, report: Report,
                     input_scales: dict[int, float] | None = None) -> list[str]:
    """Compare both models on seeded random inputs of the report's first batch shapes
    (input k divided by ``input_scales[k]`` for the patched model: a folded input).
    Returns notes (why nothing was compared); raises PatchError on a mismatch."""
    shapes = report.meta.input_shapes
    if not shapes:
        return ["FP32 equivalence not checked: the report holds no input shapes"]
    device = next((p.device for p in original.parameters()), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    inputs = tuple(torch.rand(s, generator=g).to(device) for s in shapes[0])
    try:
        scaled = tuple(x / (input_scales or {}).get(k, 1.0) for k, x in enumerate(inputs))  # all float
        want, got = original(*inputs), patched(*scaled)
    except Exception as exc:  # the report's shapes may not be all the model needs
        return [
            f"FP32 equivalence not checked: the model does not run on random inputs of the "
            f"report's shapes ({type(exc).__name__}: {exc})"
        ]
    for i, (a, b) in enumerate(zip(_floats(want), _floats(got))):
        err = relative_error(a, b)
        if not err <= TOLERANCE:
            raise PatchError(
                f"the patched model's FP32 output {i} differs from the original's (relative "
                f"error {err:.3g} > {TOLERANCE:g}): a rescaled tensor reaches it by a path the "
                "report's dataflow does not show; the model was left untouched. Keep the "
                "affected modules in FP32 instead: export(..., fp32_modules=[...])"
            )
    return []


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a| (0 for two all-zero tensors), in float64."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    scale = float(a.abs().max()) if a.numel() else 0.0
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _floats(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.is_floating_point()]
