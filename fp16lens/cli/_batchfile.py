"""Batches from files: ``.pt``/``.pth`` (torch.load, weights only), ``.npz`` and ``.npy``
(numpy).

``.pt``: a tensor is one batch with one input; a tuple is one batch with several inputs;
a dict of tensors is one batch by input name (an ONNX graph's inputs, a module's forward
keywords); a list is a list of batches (each a tensor, a tuple/list or a dict of tensors).
``.npz``: the arrays, in file order, are the model's positional inputs of one batch.
``.npy``: one array, one batch of a model with one input.
``batch_size`` splits a single batch along its first axis into several batches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp16lens._core import Fp16LensError
from fp16lens.cli._inputs import Batch


def load_batches(path: str | Path, batch_size: int | None = None) -> list[Batch]:
    path = Path(path)
    if not path.is_file():
        raise Fp16LensError(f"input file {path} does not exist; check the path")
    if path.suffix.lower() == ".npz":
        batches = [_load_npz(path)]
    elif path.suffix.lower() == ".npy":
        batches = [_load_npy(path)]
    else:
        batches = _from_object(_load_pt(path), path)
    if batch_size is not None and len(batches) == 1:
        batches = split_batch(batches[0], batch_size)
    return batches


def _load_pt(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for a bad or unsafe file
        raise Fp16LensError(
            f"cannot read input batches from {path} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); save them with "
            "torch.save(tensor | tuple | list_of_batches, path)"
        ) from exc


def _load_npz(path: Path) -> Batch:
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = [data[k] for k in data.files]
    except (OSError, ValueError) as exc:
        raise Fp16LensError(
            f"cannot read {path} as .npz ({exc}); save inputs with numpy.savez(path, x=array)"
        ) from exc
    if not arrays:
        raise Fp16LensError(f"{path} holds no arrays; save inputs with numpy.savez(path, x=array)")
    return tuple(torch.from_numpy(a) for a in arrays)


def _load_npy(path: Path) -> Batch:
    import numpy as np

    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        why = "not an array file" if "pickle" in str(exc) else str(exc).splitlines()[0]
        raise Fp16LensError(
            f"cannot read {path} as .npy ({why}); save an input with numpy.save(path, array)"
        ) from exc
    return (torch.from_numpy(np.ascontiguousarray(array)),)


def _from_object(obj, path: Path) -> list:
    if torch.is_tensor(obj):
        return [(obj,)]
    if isinstance(obj, tuple) and obj and all(torch.is_tensor(t) for t in obj):
        return [obj]
    if _named(obj):
        return [dict(obj)]
    if isinstance(obj, list) and obj:
        return [_as_batch(item, path) for item in obj]
    raise Fp16LensError(
        f"{path} holds a {type(obj).__name__}, not batches; save a tensor (one batch), a "
        "tuple of tensors (one batch, several inputs), a dict of tensors by input name (one "
        "batch) or a list of those (several batches)"
    )


def _named(obj) -> bool:
    """A dict of tensors by name: one batch by input name."""
    return (
        isinstance(obj, dict)
        and bool(obj)
        and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items())
    )


def _as_batch(item, path: Path):
    if torch.is_tensor(item):
        return (item,)
    if isinstance(item, (tuple, list)) and item and all(torch.is_tensor(t) for t in item):
        return tuple(item)
    if _named(item):
        return dict(item)
    raise Fp16LensError(
        f"{path}: a batch is a {type(item).__name__}; each list item must be a tensor, "
        "a tuple of tensors or a dict of tensors by input name"
    )


def split_batch(batch, batch_size: int) -> list:
    """Split every input along axis 0 into chunks of ``batch_size`` (the last may be short);
    a dict batch into dicts by the same names."""
    if batch_size < 1:
        raise Fp16LensError(f"--batch-size must be >= 1, got {batch_size}")
    if isinstance(batch, dict):
        names = list(batch)
        return [dict(zip(names, part)) for part in split_batch(tuple(batch.values()), batch_size)]
    sizes = {t.shape[0] if t.dim() else None for t in batch}
    if len(sizes) != 1 or None in sizes:
        raise Fp16LensError(
            "cannot split the inputs into batches: they do not share a first (batch) axis; "
            "save a list of batches instead"
        )
    chunks = [t.split(batch_size) for t in batch]
    return [tuple(parts) for parts in zip(*chunks)]
