"""The FP32 islands of a model: from its patch plan and the caller, validated."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import torch

from fp16lens._core import ExportError, OptionError
from fp16lens._core.sites import PLAN_ATTR


def resolve_fp32_modules(model: torch.nn.Module, extra: Iterable[str] | None) -> tuple[str, ...]:
    """The FP32 islands: the patch plan's ``fp32_modules`` plus ``extra``, each checked."""
    if isinstance(extra, str):
        raise OptionError(f"fp32_modules must be a list of module names, got the string {extra!r}")
    plan = getattr(model, PLAN_ATTR, None)
    wanted = [*(getattr(plan, "fp32_modules", None) or []), *(extra or [])]
    if "" in wanted:  # the whole model is an island (patch's proof kept it FP32 whole): its
        return ("",)  # other islands' names are of the model inside the wrapper, and moot
    names = {n for n, _ in model.named_modules()}
    for name in wanted:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ExportError(
                f"fp32_modules names {name!r}, which is not a module of the model.{hint}"
            )
    return tuple(dict.fromkeys(wanted))


def fp32_outputs(model: torch.nn.Module) -> tuple[str, ...]:
    """The islands of the patch plan that hand their output on in FP32 (``fp32_out``: a span
    that reaches the model output stays FP32 there, as ``.half()`` gives it)."""
    plan = getattr(model, PLAN_ATTR, None)
    islands = [*(getattr(plan, "kept", None) or []), *(getattr(plan, "islands", None) or [])]
    return tuple(dict.fromkeys(i.module for i in islands if getattr(i, "fp32_out", False)))
