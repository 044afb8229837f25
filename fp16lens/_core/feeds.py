"""One batch as ONNX Runtime inputs: which item goes to which graph input (shared by the
INT8 calibration in export and the ONNX scan in watch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fp16lens._core.errors import Fp16LensError

ONNX_FLOATS = {1: np.float32, 10: np.float16, 11: np.float64, 16: np.float32}  # 16: bfloat16
"""ONNX float element types and the numpy dtype a feed of each gets (bfloat16 as float32)."""


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


def as_input(item: Any, elem: int | None) -> np.ndarray:
    """``item`` (a tensor or array) as ONNX Runtime takes it for a graph input of element
    type ``elem``: a float array cast to that float type (an FP16 file's inputs fed from
    FP32 arrays, or its FP32 twin's from FP16 ones), anything else as it is."""
    if hasattr(item, "detach"):  # a torch tensor (torch is not imported here)
        item = item.detach().cpu().numpy()
    a = np.asarray(item)
    if a.dtype.kind == "f" and elem in ONNX_FLOATS:
        a = a.astype(ONNX_FLOATS[elem], copy=False)
    return a
