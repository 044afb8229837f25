"""What ``inputs`` may be: one tensor, one tuple of positional tensors, or batches of those."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fp16lens._core import VerifyError


def as_batches(inputs) -> list[tuple]:
    """A list of batches, each a tuple of positional arguments.

    A tensor is one batch; a tuple is one batch of positional arguments (the form
    ``model(*inputs)`` takes); a list or any other iterable is several batches, each a
    tensor or a tuple.
    """
    if torch.is_tensor(inputs) or isinstance(inputs, tuple):
        batches = [inputs]
    elif isinstance(inputs, Iterable) and not isinstance(inputs, (str, bytes, dict)):
        batches = list(inputs)
    else:
        raise VerifyError(
            f"inputs must be a tensor, a tuple of positional tensors, or an iterable of "
            f"those (one per batch); got {type(inputs).__name__}"
        )
    if not batches:
        raise VerifyError("inputs holds no batch; pass at least one representative input")
    return [b if isinstance(b, tuple) else (b,) for b in batches]


def cast_floats(batch: tuple, dtype: torch.dtype, device=None) -> tuple:
    """The batch with its floating tensors cast to ``dtype`` (others kept), moved to ``device``."""
    return tuple(_cast(a, dtype, device) for a in batch)


def _cast(a, dtype, device):
    if not torch.is_tensor(a):
        return a
    a = a.to(device) if device is not None else a
    return a.to(dtype) if a.is_floating_point() else a


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's first parameter (or buffer) lives; CPU for a stateless model."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")
