"""What every torch watch session shares (``watch()``'s Lens and the compiled scan): the
check of the model, the set of models being watched, the parameters' check, and the
finished report (built, merged over ranks, advised by patch's planner)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fp16lens._core import WatchError
from fp16lens._core.model_dtype import half_model
from fp16lens._core.weights import missing_weights
from fp16lens.report import Report
from fp16lens.watch import _distributed
from fp16lens.watch._accumulate import Accumulator
from fp16lens.watch._advise import advised
from fp16lens.watch._build import build_report
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._params import check_parameters
from fp16lens.watch._recorder import SiteInfo

ACTIVE: weakref.WeakSet = weakref.WeakSet()


def check_model(model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise WatchError(
            f"watch() needs a torch.nn.Module, got {type(model).__name__}; "
            "pass the model object itself (not its output, state_dict or a path)"
        )
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise WatchError(
            "watch() cannot see inside a torch.compile'd model (compiled graphs bypass "
            "module hooks and eager ops); watch model._orig_mod (the uncompiled module) "
            "and call that one inside the block"
        )
    why = missing_weights(model)
    if why is not None:
        raise WatchError(f"watch() cannot run this model: {why}")
    why = half_model(model)
    if why is not None:
        raise WatchError(f"watch() measures a model in FP32: {why}")
    if isinstance(model, torch.jit.ScriptModule):
        raise WatchError(
            "watch() needs an eager nn.Module; TorchScript modules run their own "
            "interpreter. Load the model from its Python definition instead"
        )
    if model in ACTIVE:
        raise WatchError(
            "this model is already being watched by an enclosing watch() block; "
            "use one block (statistics accumulate over any number of forward calls)"
        )


def parameters(model: torch.nn.Module, options: WatchOptions) -> list:
    """The parameter problems of ``model`` (none when ``options.params`` is off)."""
    return check_parameters(model, options) if options.params else []


def finished_report(
    acc: Accumulator,
    sites: list[SiteInfo],
    params: list,
    model: torch.nn.Module,
    options: WatchOptions,
    notes: Sequence = (),
) -> Report:
    """The report of a finished session: built from ``acc``, merged over ranks when
    distributed, the ``notes`` (findings) added, and the plan's advice asked for."""
    report = build_report(acc, sites, params, model, options.threshold)
    if _distributed.enabled(options.distributed):
        report = _distributed.merge_over_ranks(report)
    report.findings.extend(notes)
    return advised(model, report, options.advise)
