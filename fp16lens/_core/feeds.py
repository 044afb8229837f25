"""One batch as ONNX Runtime inputs: which item goes to which graph input (shared by the
INT8 calibration in export and the ONNX scan in watch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp16lens._core.errors import Fp16LensError


def feed_items(
    batch: Any, names: list[str], error: type[Fp16LensError], what: str = "the model"
) -> list[tuple[str, Any]]:
    """``(input name, item)`` pairs for ``batch``: a dict by input name, a tuple or list in
    input order, or a single tensor/array for a one-input graph. A batch that does not fit
    raises ``error`` naming the inputs and what to pass instead."""
    if isinstance(batch, Mapping):
        missing = [n for n in names if n not in batch]
        if missing:
            raise error(
                f"the batch has no array for input(s) {', '.join(missing)} of {what} (it has "
                f"{', '.join(map(str, batch)) or 'none'}); name the arrays as the inputs"
            )
        return [(n, batch[n]) for n in names]
    items = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    if len(items) != len(names):
        raise error(
            f"{what} takes {len(names)} input(s) ({', '.join(names)}) but the batch holds "
            f"{len(items)} tensor(s); pass one tuple of inputs per batch in that order, or a dict by name"
        )
    return list(zip(names, items))
