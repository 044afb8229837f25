"""A cheap fingerprint of a model's weights, so that a report is not applied to other weights.

Per floating parameter/buffer, from its bits, in one pass: the tensor's bytes read as 32-bit
integer words (16- or 8-bit where the size needs it), laid out in rows of 97 in memory order
of the contiguous tensor, and summed per column in integer arithmetic. Integer addition does
not depend on the order, so the sums modulo 2^32 are the same on every device and torch
release, and exact: a changed value changes one column sum by a non-zero amount modulo 2^32.
A row holds [numel, Σ c_j, -1 - Σ (2j+1)·c_j, Σ (2j+1)²·c_j], each sum modulo 2^32 over
the 97 column sums c_j (odd weights keep every change visible; different weights per column
make moving values to another column, such as permuting channels, a change).

Reports made before this hold [numel, Σv, Σ|v|, Σv·ramp] in float64 (r = 1 + (i mod 97));
their third number is never negative, this format's always is, so ``changed`` tells them
apart and checks an old report the old way, within 1e-9 of the tensor's magnitude Σ|v|.
"""

from __future__ import annotations

import math

import torch

from fp16lens._core import threads

_RAMP = 97  # the columns (a prime: rows of a weight are rarely a multiple of it)
_TOLERANCE = 1e-9  # (the float64 format of older reports)
_MASK = (1 << 32) - 1
_WORDS = (torch.int32, torch.int16, torch.int8)


def _tensors(model: torch.nn.Module):
    named = list(model.named_parameters(remove_duplicate=True)) + list(
        model.named_buffers(remove_duplicate=True)
    )
    return [(n, t) for n, t in named if torch.is_tensor(t) and t.is_floating_point()]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat tensor of the widest integer words that tile them."""
    v = t.detach()
    v = (v if v.is_contiguous() else v.contiguous()).reshape(-1)
    if v.numel() == 0:
        return v.new_zeros(0, dtype=torch.int32)
    raw = v.view(torch.uint8)
    for dtype in _WORDS:
        size = torch.empty(0, dtype=dtype).element_size()
        if raw.numel() % size == 0 and raw.storage_offset() % size == 0:
            return raw.view(dtype)
    return raw.view(torch.int8)


def _columns(t: torch.Tensor) -> torch.Tensor:
    """The 97 column sums of ``t``'s words, modulo 2^32 (int32)."""
    w = _words(t)
    full = w.numel() - w.numel() % _RAMP
    cols = (
        w[:full].view(-1, _RAMP).sum(0, dtype=torch.int32)
        if full
        else torch.zeros(_RAMP, dtype=torch.int32, device=w.device)
    )
    if full < w.numel():
        cols[: w.numel() - full] += w[full:]
    return cols


_SMALL = 1 << 14  # float32 tensors of at most this many values are summed together


def _columns_small(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``_columns`` of many small float32 tensors on one device, (n, 97), in a few ops
    for all of them: their words laid end to end, each added into its tensor's column."""
    words = torch.cat([t.detach().reshape(-1).view(torch.int32) for t in tensors])
    device = words.device
    lengths = torch.tensor([t.numel() for t in tensors], device=device)
    which = torch.repeat_interleave(torch.arange(len(tensors), device=device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(words.numel(), device=device) - starts[which]
    cols = torch.zeros(len(tensors) * _RAMP, dtype=torch.int32, device=device)
    cols.index_add_(0, which * _RAMP + position % _RAMP, words)  # wraps modulo 2^32
    return cols.view(len(tensors), _RAMP)


def _coefficients() -> torch.Tensor:
    odd = torch.arange(1, 2 * _RAMP, 2, dtype=torch.int64)
    return torch.stack([torch.ones_like(odd), odd, odd * odd], dim=1)  # (97, 3)


@torch.no_grad()
def fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """Pure: the fingerprint of ``model``'s floating parameters and buffers, by name."""
    return _rows(_tensors(model))


def _rows(named: list[tuple[str, torch.Tensor]]) -> dict[str, list[float]]:
    if not named:
        return {}
    cols: list[torch.Tensor | None] = [None] * len(named)
    small: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        if t.dtype == torch.float32 and 0 < t.numel() <= _SMALL and t.is_contiguous():
            small.setdefault(t.device, []).append(i)
    for at in small.values():
        for i, row in zip(at, _columns_small([named[i][1] for i in at]).unbind(0)):
            cols[i] = row
    full = [
        c if c is not None else threads.on_threads(_columns, t) for c, (_, t) in zip(cols, named)
    ]
    same = len({c.device for c in full}) == 1  # one transfer, not one sync per tensor
    stacked = torch.stack(full).cpu() if same else torch.stack([c.cpu() for c in full])
    stacked = stacked.to(torch.int64) & _MASK
    sums = ((stacked @ _coefficients()) & _MASK).tolist()  # < 97 * 193² * 2^32 < 2^63: exact
    return {
        name: [float(t.numel()), float(a), -1.0 - b, float(c)]
        for (name, t), (a, b, c) in zip(named, sums)
    }


def _is_bits(row: list[float]) -> bool:
    return row[2] < 0  # Σ|v| in the older float64 format, never negative


def changed(recorded: dict[str, list[float]], model: torch.nn.Module) -> list[str]:
    """Names of the tensors that both have and whose weights differ from ``recorded``;
    [] when ``recorded`` is empty (a report made before fingerprints). Tensors only one side
    has mean another architecture, which patch's site check names as such."""
    if not recorded:
        return []
    tensors = {n: t for n, t in _tensors(model) if n in recorded}
    bits = [n for n in tensors if _is_bits(recorded[n])]
    now = _rows([(n, tensors[n]) for n in bits])
    out = [n for n in bits if not _same_bits(recorded[n], now[n])]
    out += [
        n
        for n in tensors.keys() - set(bits)
        if not _same_float(recorded[n], _float_row(tensors[n]))
    ]
    return sorted(out)


def _same_bits(a: list[float], b: list[float]) -> bool:
    """Integers compared as such (a JSON round trip or a last-bit change of the float that
    carries one cannot make two of them differ)."""
    return all(math.isfinite(x) and round(x) == round(y) for x, y in zip(a, b))


@torch.no_grad()
def _float_row(t: torch.Tensor) -> list[float]:
    """The older float64 format of one tensor: [numel, Σv, Σ|v|, Σv·ramp]."""
    v = t.detach().reshape(-1).double()
    ramp = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % _RAMP + 1
    return [float(v.numel()), *torch.stack([v.sum(), v.abs().sum(), (v * ramp).sum()]).tolist()]


def _same_float(recorded: list[float], now: list[float]) -> bool:
    (n0, *a), (n1, *b) = recorded, now
    scale = _TOLERANCE * max(abs(a[1]), abs(b[1]))
    tolerances = (scale, scale, scale * _RAMP)
    return n0 == n1 and all(_same(x, y, t) for x, y, t in zip(a, b, tolerances))


def _same(x: float, y: float, tolerance: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y)) or abs(x - y) <= tolerance


# ---- ONNX graphs (kept apart from the torch fingerprint above) ----------------------------
_ONNX_FLOATS = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


def onnx_fingerprint(model) -> dict[str, list[float]]:
    """Pure: the fingerprint of an ONNX ``model``'s (a ModelProto, external data loaded)
    float initializers, by initializer name: four float64 sums per tensor (numel, Σv,
    Σ|v|, Σv·ramp), the format module fingerprints had before their integer form;
    ``differing`` compares them within a relative tolerance."""
    import numpy as np
    from onnx import numpy_helper

    out = {}
    for init in model.graph.initializer:
        if init.data_type not in _ONNX_FLOATS:
            continue
        flat = numpy_helper.to_array(init).reshape(-1)
        sums = np.zeros(3)
        for start in range(0, flat.size, _CHUNK):  # float64 a chunk at a time: large weights
            v = flat[start : start + _CHUNK].astype(np.float64)
            ramp = np.arange(start, start + v.size, dtype=np.int64) % _RAMP + 1
            sums += (v.sum(), np.abs(v).sum(), (v * ramp).sum())
        out[init.name] = [float(flat.size), *map(float, sums)]
    return out


_CHUNK = 1 << 22


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
