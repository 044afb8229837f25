"""Stage subpackages that are also their main function: ``fp16lens.patch(model, report)``
calls ``fp16lens.patch.patch`` while ``fp16lens.patch.plan`` stays reachable."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable


class _CallableModule(types.ModuleType):
    _fp16lens_call: Callable

    def __call__(self, *args, **kwargs):
        return self._fp16lens_call(*args, **kwargs)


def make_callable(module_name: str, fn: Callable) -> None:
    """Make the (already imported) module ``module_name`` callable as ``fn``."""
    module = sys.modules[module_name]
    module.__class__ = _CallableModule
    module._fp16lens_call = fn
