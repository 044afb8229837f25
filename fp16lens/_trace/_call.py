"""Calling a model on one batch, as every stage takes batches."""

from __future__ import annotations

from typing import Any


def call_model(model, batch: Any):
    """A batch is a tensor, a tuple/list of positional arguments, or a dict of keywords."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)
