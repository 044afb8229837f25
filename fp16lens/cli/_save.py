"""Saving a (patched) model so that MODEL arguments can load it again."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from fp16lens._core import Fp16LensError
from fp16lens._core.paths import check_writable

if TYPE_CHECKING:
    from torch import nn

SAVE_SUFFIXES = (".pt", ".pth", ".pt2")


def check_save_path(path: str | Path) -> Path:
    """The path, when its suffix says how to save and it can be written; checked before
    any work is done (OutputPathError otherwise: nothing is written)."""
    path = Path(path)
    if path.suffix.lower() not in SAVE_SUFFIXES:
        raise Fp16LensError(
            f"cannot save a model as {path.suffix or 'a file without suffix'!r}; use .pt2 "
            "(torch.export program, recommended) or .pt (TorchScript)"
        )
    return check_writable(path)


def save_model(model: nn.Module, example: tuple, path: str | Path) -> Path:
    """``.pt2``: a torch.export program; ``.pt``/``.pth``: TorchScript traced on ``example``."""
    import torch

    path = check_save_path(path)
    suffix = path.suffix.lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    from fp16lens.patch import ISLANDS_FILE, islands_metadata, portable

    model = model.eval()
    meta = {ISLANDS_FILE: islands_metadata(model)}
    # FP32 islands in a form that a file keeps: they stay FP32 under a later .half()
    model = portable(model, "bits" if suffix == ".pt2" else "const")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecation notices
        if suffix == ".pt2":
            try:
                program = torch.export.export(model, tuple(example))
            except Exception as exc:  # torch.export cannot capture every forward
                said = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise Fp16LensError(
                    f"torch.export cannot capture the patched model ({type(exc).__name__}: "
                    f"{said}); save it as TorchScript instead (-o {path.with_suffix('.pt').name})"
                ) from exc
            torch.export.save(program, str(path), extra_files=meta)
        else:
            traced = torch.jit.trace(model, tuple(example), strict=False, check_trace=False)
            traced.save(str(path), _extra_files=meta)
    return path
