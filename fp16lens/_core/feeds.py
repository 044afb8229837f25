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


def declared_batch(graph: Any) -> int | None:
    """The first axis every graph input (initializers aside) declares, where they all
    declare the same fixed one (1 for a graph exported to take one item at a time); None
    where any input's first axis is free or unknown, or they differ. ``graph`` is an ONNX
    ModelProto, or the path of an .onnx file (read without its external weights)."""
    if isinstance(graph, (str, bytes)) or hasattr(graph, "__fspath__"):
        try:
            import onnx

            graph = onnx.load(str(graph), load_external_data=False)
        except Exception:  # the command itself says what is wrong with the file
            return None
    init = {i.name for i in graph.graph.initializer}
    firsts = set()
    for v in graph.graph.input:
        if v.name in init:
            continue
        shape = v.type.tensor_type.shape if v.type.tensor_type.HasField("shape") else None
        first = shape.dim[0].dim_value if shape is not None and shape.dim else 0
        firsts.add(first if first > 0 else None)  # -1, as some exporters write: free
    return firsts.pop() if len(firsts) == 1 and None not in firsts else None


def split_to_declared(batches: list, size: int | None) -> tuple[list, str]:
    """``batches`` (each a dict by input name, a tuple/list in input order, or one tensor
    or array) as the graph takes them, with a note: a single batch of N items, where every
    input shares the first axis N and N is a multiple of the graph's fixed first axis
    ``size`` < N, as N/size batches of ``size`` items (a calibration or evaluation file of
    N images for a graph exported with batch 1); anything else as it is, with no note."""
    if size is None or len(batches) != 1:
        return batches, ""
    batch = batches[0]
    values = (
        list(batch.values())
        if isinstance(batch, Mapping)
        else list(batch)
        if isinstance(batch, (tuple, list))
        else [batch]
    )
    firsts = {v.shape[0] if getattr(v, "shape", ()) else None for v in values}
    n = firsts.pop() if len(firsts) == 1 else None
    if not n or n <= size or n % size:
        return batches, ""

    def part(v, i):
        return v[i * size : (i + 1) * size]

    count = n // size
    parts: list[Any]
    if isinstance(batch, Mapping):
        parts = [{k: part(v, i) for k, v in batch.items()} for i in range(count)]
    elif isinstance(batch, (tuple, list)):
        parts = [type(batch)(part(v, i) for v in batch) for i in range(count)]
    else:
        parts = [part(batch, i) for i in range(count)]
    what = "its items" if size == 1 else f"{count} batches of {size}"
    return parts, f"the batch of {n} items split into {what} (the graph's first axis is {size})"
