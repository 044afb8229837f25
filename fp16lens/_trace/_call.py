"""Calling a model on one batch, as every stage takes batches."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def call_args(batch: Any) -> tuple[tuple, dict]:
    """(positional arguments, keywords) of a batch: a tensor, a tuple/list of positional
    arguments, or a dict of keywords."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def call_model(model, batch: Any):
    """``model`` on one batch (``call_args``)."""
    args, kwargs = call_args(batch)
    return model(*args, **kwargs)


def float_outputs(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output, in pytree order."""
    return [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.is_floating_point()]
