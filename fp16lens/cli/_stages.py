"""Later stages, imported when a command runs (never at ``fp16lens --help`` time)."""

from __future__ import annotations

import importlib

from fp16lens._core import Fp16LensError


def stage(module: str, attr: str, command: str):
    """``module.attr``, or an Fp16LensError when this build of fp16lens lacks that stage."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        mod = None
    found = getattr(mod, attr, None)
    if found is None:
        raise Fp16LensError(
            f"`fp16lens {command}` needs {module}.{attr}, which this build of fp16lens does "
            "not include; reinstall it from the clone (pip install -e .)"
        )
    return found
