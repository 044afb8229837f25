"""A model's float dtype: what its float inputs must be cast to (watch and the CLI ask)."""

from __future__ import annotations

import torch


def model_float_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter (or buffer); None when it has none."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None
