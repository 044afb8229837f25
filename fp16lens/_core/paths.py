"""Output paths checked before the work that writes them (a slow export, a demo run).

Permission bits do not tell: root passes ``os.access`` on a read-only mount or on /proc.
The check creates (and removes) a probe file in the deepest folder that exists, so it
leaves nothing behind and creates no folder; the writer makes missing folders later.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fp16lens._core.errors import Fp16LensError, OutputPathError

FIX = "choose a writable location (a path in a folder you can write to)"


def check_writable(
    path: str | Path, *, folder: bool = False, error: type[Fp16LensError] = OutputPathError
) -> Path:
    """``path`` when a file (``folder``: a folder) can be written there, else ``error``."""
    path = Path(path)
    try:
        _probe(path, folder)
    except OSError as exc:
        raise error(f"cannot write {path}: {exc.strerror or exc}; {FIX}") from exc
    return path


def _probe(path: Path, folder: bool) -> None:
    if path.exists() and path.is_dir() != folder:
        what = "a folder" if path.is_dir() else "a file"
        raise OSError(0, f"it is {what}, not {'a folder' if folder else 'a file'}")
    if path.exists() and not folder:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND))  # writable, left as it was
        return
    ancestor = path if folder and path.exists() else path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OSError(0, f"{ancestor} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".fp16lens-probe-")
    except OSError as exc:
        raise OSError(exc.errno, f"{ancestor} accepts no new file ({exc.strerror})") from exc
    os.close(fd)
    os.unlink(probe)


SAVE_SUFFIXES = (".pt", ".pt2", ".pth")
"""How a model is saved: ``.pt2`` a torch.export program, ``.pt``/``.pth`` TorchScript."""


def check_save_path(path: str | Path) -> Path:
    """The path, when its suffix says how to save a model and it can be written; checked
    before any work is done (nothing is written otherwise)."""
    path = Path(path)
    if path.suffix.lower() not in SAVE_SUFFIXES:
        raise Fp16LensError(
            f"cannot save a model as {path.suffix or 'a file without suffix'!r}; use .pt2 "
            "(torch.export program, recommended) or .pt (TorchScript)"
        )
    return check_writable(path)
