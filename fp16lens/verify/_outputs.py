"""Model outputs as named leaves: ``logits``, ``aux.0``, ``0`` ... (None and non-tensors dropped)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def named_leaves(output: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a (nested) output with its path; a bare tensor is ``output``."""
    if torch.is_tensor(output):
        return [(prefix or "output", output)]
    if isinstance(output, Mapping):
        items = [(str(k), v) for k, v in output.items()]
    elif isinstance(output, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(output)]
    else:
        return []
    leaves: list[tuple[str, torch.Tensor]] = []
    for key, value in items:
        leaves.extend(named_leaves(value, f"{prefix}.{key}" if prefix else key))
    return leaves
