"""One helper for optional dependencies (pandas' import_optional_dependency pattern)."""

from __future__ import annotations

import importlib
import types

from fp16lens._core.errors import MissingDependencyError


def import_optional(module: str, extra: str, purpose: str = "") -> types.ModuleType:
    """Import ``module`` or raise MissingDependencyError naming ``pip install -e '.[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(module, extra, purpose) from exc
