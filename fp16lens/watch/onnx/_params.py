"""Float constants of an ONNX graph that FP16 cannot hold, by the rules ``watch._params``
applies to a module's parameters. A finding's site is the first node that reads the
constant (its values join that node's output, which ``judge`` weighs the loss against);
``tensor`` is the constant's own name."""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch

from fp16lens._core.flush import flush_loss
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.watch._harm import GUARD_FIX
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._params import ParamCheck, _overflow, _small

if TYPE_CHECKING:  # onnx is optional (and not followed by mypy: its names are Any)
    from onnx import NodeProto

_BIAS_SLOT = {
    "Conv": 2,
    "ConvTranspose": 2,
    "Gemm": 2,
    "BatchNormalization": 2,
    "InstanceNormalization": 2,
    "LayerNormalization": 2,
    "GroupNormalization": 2,
}
_BN_STATS = (3, 4)  # running mean and variance: folded in FP32 before deployment


def _is_guard(node, slot: int) -> bool:
    """Whether input ``slot`` of ``node`` keeps values off 0: an added eps, a Max/Clip bound."""
    return node.op_type in ("Add", "Max") or (node.op_type == "Clip" and slot == 1)


def _uses(graph, name: str) -> list[tuple[NodeProto, int]]:
    return [
        (graph.nodes[s], i)
        for s in dict.fromkeys(graph.consumers.get(name, []))
        for i, t in enumerate(graph.nodes[s].input)
        if t == name
    ]


def _tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a float32 tensor, without a copy where it is float32 already (a large
    model's weights; a read-only array's tensor is only read here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array.astype("float32", copy=False))


def check_constants(graph, options: WatchOptions) -> list[ParamCheck]:
    checks = []
    site_of = {id(n): graph.sites[s].name for s, n in enumerate(graph.nodes)}
    for name, array in graph.consts.items():
        uses = _uses(graph, name)
        if not uses or array.size == 0:
            continue  # read by no float node (shapes, scales of a non-float op)
        site = site_of[id(uses[0][0])]
        t = _tensor(array)
        a = t.abs()
        over = _overflow(name, t, a, options.threshold)
        if over is not None:
            checks.append(ParamCheck(dataclasses.replace(over, site=site, tensor=name)))
        if all(n.op_type == "BatchNormalization" and i in _BN_STATS for n, i in uses):
            continue
        small = _small(name, a, options)
        if small is not None:
            guard = bool((t > 0).all()) and all(_is_guard(n, i) for n, i in uses)
            additive = guard or all(
                n.op_type in ("Add", "Sub") or _BIAS_SLOT.get(n.op_type) == i for n, i in uses
            )
            checks.append(
                ParamCheck(
                    dataclasses.replace(small, site=site, tensor=name),
                    additive,
                    flush_loss(t),
                    guard,
                )
            )
    return checks


def guard_constants(report, guards: dict[str, str]) -> None:
    """A constant whose vanishing the underflow check saw at a singular node (``guards``:
    guard site -> singular site) is a problem, whatever its magnitude next to the values
    (``watch._harm`` says so already where the joined values' statistics show the flush)."""
    for i, f in enumerate(report.findings):
        target = guards.get(f.site)
        if target is None or f.kind != FindingKind.PARAM_UNDERFLOW or f.mechanism != Mechanism.NOTE:
            continue
        report.findings[i] = dataclasses.replace(
            f,
            mechanism=Mechanism.PARAMETER,
            detail=f"{f.detail.split('; harmless')[0]}; visible: it guards {target}, which real "
            "FP16 makes non-finite without it",
            fix=GUARD_FIX.format(start=f.site, end=target),
        )
