"""Stage packages that are also their main function.

``fp16lens.patch(model, report)`` calls ``fp16lens.patch.patch`` while
``fp16lens.patch.plan``, ``fp16lens.patch.PatchOptions``, ``from fp16lens.patch import ...``
and ``import fp16lens.patch._patch as m`` keep working: the package stays a module, of a
``StageModule`` subclass whose ``__call__`` *is* the stage function.

What a person, an IDE and a type checker see is that function:

* each stage package defines ``class _Stage(StageModule): __call__ = staticmethod(fn)``
  and binds ``entry = stage_module(__name__, _Stage, fn)``; ``fp16lens/__init__.py``
  imports ``entry`` under the stage's name, so mypy types ``fp16lens.patch(...)`` with
  ``fn``'s own parameters (``tests/core/test_entry_points.py`` runs mypy on the README);
* ``inspect.signature(fp16lens.patch)`` is ``fn``'s signature (``__signature__``).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

StageT = TypeVar("StageT", bound="StageModule")


class StageModule(types.ModuleType):
    """A stage package callable as its main function (subclassed once per stage, with
    ``__call__ = staticmethod(fn)`` and the names a checker should type precisely; the
    package's other names are found in the module's ``__dict__`` as for any module, and
    typed ``Any`` by typeshed's ``ModuleType.__getattr__``)."""


def stage_module(module_name: str, cls: type[StageT], fn: Callable[..., Any]) -> StageT:
    """Make the (already imported) package ``module_name`` an instance of ``cls`` (whose
    ``__call__`` is ``fn``) and return it, typed as ``cls``."""
    module = sys.modules[module_name]
    module.__class__ = cls
    # inspect.signature(module) reads __signature__ first; without it inspect would take
    # cls.__call__ as a method and drop fn's first parameter.
    module.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]  # (set on the instance)
    return cast(StageT, module)
