"""A model's float dtype: what its float inputs must be cast to (watch and the CLI ask)."""

from __future__ import annotations

import torch


def model_float_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter (or buffer); None when it has none."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def half_model(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be measured for FP16 (it already runs in float16: most of its
    floating parameter and buffer elements are float16), naming the fix; else None. Its
    values would be FP16's own, inf wherever FP16 already overflowed, where fp16lens needs
    the FP32 values to measure against FP16's limits."""
    half = total = 0
    first = ""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_floating_point():
            total += t.numel()
            if t.dtype == torch.float16:
                half += t.numel()
                first = first or name
    if not total or half * 2 < total:
        return None
    return (
        f"its weights are float16 ({half / total:.0%} of them, {first} first), so its values "
        "are FP16's own (inf where FP16 overflowed, not how far FP32 goes); pass the FP32 "
        "model (model.float()) with FP32 inputs"
    )
