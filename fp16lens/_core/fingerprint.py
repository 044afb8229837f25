"""A cheap fingerprint of a model's weights, so that a report is not applied to other weights.

Per floating parameter/buffer: [numel, Σv, Σ|v|, Σv·r] in float64, with r = 1 + (i mod 97)
a position ramp (a permutation changes it). One pass per tensor, on the tensor's device, one
host transfer at the end. Two fingerprints match when every number agrees within 1e-9 of
the tensor's magnitude Σ|v| (×97 for the ramp sum): the same weights on another device
reduce in another order and differ in the last bits (float64: ~1e-16 per term); a change
smaller than that cannot move a range a report holds.
"""

from __future__ import annotations

import math

import torch

_RAMP = 97
_TOLERANCE = 1e-9


def _tensors(model: torch.nn.Module):
    named = list(model.named_parameters(remove_duplicate=True)) + list(
        model.named_buffers(remove_duplicate=True)
    )
    return [(n, t) for n, t in named if torch.is_tensor(t) and t.is_floating_point()]


@torch.no_grad()
def fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """Pure: the fingerprint of ``model``'s floating parameters and buffers, by name."""
    names, rows = [], []
    for name, t in _tensors(model):
        v = t.detach().reshape(-1).double()
        ramp = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % _RAMP + 1
        rows.append(torch.stack([v.sum(), v.abs().sum(), (v * ramp).sum()]).cpu())
        names.append((name, t.numel()))
    values = torch.stack(rows).tolist() if rows else []
    return {name: [float(n), *row] for (name, n), row in zip(names, values)}


def changed(recorded: dict[str, list[float]], model: torch.nn.Module) -> list[str]:
    """Names of the tensors that both have and whose weights differ from ``recorded``;
    [] when ``recorded`` is empty (a report made before fingerprints). Tensors only one side
    has mean another architecture, which patch's site check names as such."""
    if not recorded:
        return []
    now = fingerprint(model)
    out = []
    for name in recorded.keys() & now.keys():
        (n0, *a), (n1, *b) = recorded[name], now[name]
        scale = _TOLERANCE * max(abs(a[1]), abs(b[1]))
        tolerances = (scale, scale, scale * _RAMP)
        if n0 != n1 or not all(_same(x, y, t) for x, y, t in zip(a, b, tolerances)):
            out.append(name)
    return sorted(out)


def _same(x: float, y: float, tolerance: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y)) or abs(x - y) <= tolerance


# ---- ONNX graphs (kept apart from the torch fingerprint above) ----------------------------
_ONNX_FLOATS = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


def onnx_fingerprint(model) -> dict[str, list[float]]:
    """Pure: the fingerprint of an ONNX ``model``'s (a ModelProto, external data loaded)
    float initializers, by initializer name: the same four numbers per tensor as
    ``fingerprint`` gives a module's parameters, in float64 with numpy."""
    import numpy as np
    from onnx import numpy_helper

    out = {}
    for init in model.graph.initializer:
        if init.data_type not in _ONNX_FLOATS:
            continue
        v = numpy_helper.to_array(init).astype(np.float64).reshape(-1)
        ramp = np.arange(v.size, dtype=np.int64) % _RAMP + 1
        out[init.name] = [float(v.size), float(v.sum()), float(np.abs(v).sum()), float((v * ramp).sum())]
    return out


def onnx_changed(recorded: dict[str, list[float]], model) -> list[str]:
    """``changed`` for an ONNX ``model``: the initializers both have whose values differ
    from ``recorded`` (a report's ``weights``); [] when ``recorded`` is empty."""
    if not recorded:
        return []
    return differing(recorded, onnx_fingerprint(model))


def differing(recorded: dict[str, list[float]], now: dict[str, list[float]]) -> list[str]:
    """Names in both fingerprints whose numbers disagree beyond the tolerance (sorted)."""
    out = []
    for name in recorded.keys() & now.keys():
        (n0, *a), (n1, *b) = recorded[name], now[name]
        scale = _TOLERANCE * max(abs(a[1]), abs(b[1]))
        tolerances = (scale, scale, scale * _RAMP)
        if n0 != n1 or not all(_same(x, y, t) for x, y, t in zip(a, b, tolerances)):
            out.append(name)
    return sorted(out)
