"""Batches from files: ``.pt``/``.pth`` (torch.load, weights only), ``.npz`` and ``.npy``
(numpy).

``.pt``: a tensor (or a NumPy array: any array in the file is taken as a tensor) is one
batch with one input; a tuple is one batch with several inputs;
a dict of tensors is one batch by input name (an ONNX graph's inputs, a module's forward
keywords); a list is a list of batches (each a tensor, a tuple/list or a dict of tensors).
``.npz``: the arrays, in file order, are the model's positional inputs of one batch.
``.npy``: one array, one batch of a model with one input.
``batch_size`` splits a single batch along its first axis into several batches.
"""

from __future__ import annotations

import contextlib
import re
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
    """torch.load, weights only: tensors, and NumPy arrays (batches made with NumPy, as an
    ONNX model's often are), whose few reconstruction globals are allowed for this load;
    any other object is refused, never unpickled."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for a bad or unsafe file
        error = exc
    if "numpy" in str(error):
        try:
            with _numpy_allowed():
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            error = exc
    raise Fp16LensError(
        f"cannot read input batches from {path} ({type(error).__name__}: {_why(error)}); "
        "save them with torch.save(tensor | tuple | dict | list_of_batches, path), of tensors "
        "or NumPy arrays"
    ) from error


def _why(exc: Exception) -> str:
    """The line of a torch.load error that names the cause (a weights-only load's refused
    global), without the terminal's escape codes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    for line in lines:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", line)
        if found:
            return f"it holds {found.group(1)}, which a weights-only load does not run"
    return lines[0] if lines else ""


@contextlib.contextmanager
def _numpy_allowed():
    """NumPy's array reconstruction allowed in a weights-only load, for this load only:
    ``_reconstruct`` builds an ndarray (the only subtype allowed) of an allowed dtype, from
    bytes that NumPy 1 pickles as ``_codecs.encode`` of a string (no code of the file's)."""
    import _codecs

    import numpy as np

    # the functions an array and a NumPy scalar pickle by, wherever this NumPy keeps them
    rebuild, scalar = np.zeros(1).__reduce__()[0], np.float32(0).__reduce__()[0]
    allowed = [rebuild, scalar, np.ndarray, np.dtype, _codecs.encode]  # NumPy 1's array bytes
    dtypes = getattr(np, "dtypes", None)  # NumPy 1.25 and later pickle a dtype by its class
    allowed += [t for t in vars(dtypes).values() if isinstance(t, type)] if dtypes else []
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


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
    return tuple(_tensor(a) for a in arrays)


def _load_npy(path: Path) -> Batch:
    import numpy as np

    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        why = "not an array file" if "pickle" in str(exc) else str(exc).splitlines()[0]
        raise Fp16LensError(
            f"cannot read {path} as .npy ({why}); save an input with numpy.save(path, array)"
        ) from exc
    return (_tensor(array),)


def _tensor(a):
    """A NumPy array as a tensor of its shape (``np.ascontiguousarray`` would make a 0-d
    array 1-d: a sample rate, a scale)."""
    return torch.from_numpy(a if a.flags.c_contiguous else a.copy())


def _tensors(obj):
    """``obj`` with every NumPy array in it (nested in tuples, lists and dicts) a tensor."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return _tensor(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_tensors(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    return obj


def _from_object(obj, path: Path) -> list:
    obj = _tensors(obj)
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
