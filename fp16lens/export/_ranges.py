"""Range checks for weights that become FP16 (the thresholds watch uses for parameters)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fp16lens._core import FP16_MIN_NORMAL, ExportError
from fp16lens._core.flush import REL_STEP, flush_loss, percent
from fp16lens._core.underflow import ONNX_GUARDS, flushes


@dataclass(frozen=True)
class RangeIssues:
    """What converting one FP32 array to FP16 does to it."""

    absmax: float
    overflow: int  # finite, becomes inf in FP16 (|v| >= 65520); an inf or NaN stays as it is
    subnormal: int  # non-zero values below 2**-14 in FP16 (precision lost), zeroed included
    zeroed: int  # non-zero values that round to 0
    lost_rel: float = 0.0  # the most a slice (output channel) loses below 2**-14, over its sum |w|


def range_issues(array: np.ndarray) -> RangeIssues:
    """Pure: what rounding ``array`` to FP16 does to it (judged on the rounded values)."""
    a = np.asarray(array, dtype=np.float32)
    if a.size == 0:
        return RangeIssues(0.0, 0, 0, 0)
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    zeroed = int(((a != 0) & (h == 0)).sum())
    subnormal = int(((h != 0) & (np.abs(h) < FP16_MIN_NORMAL)).sum()) + zeroed
    # ONNX keeps the output channel first (Conv, Gemm with transB) or last (MatMul): both
    lost = flush_loss(torch.from_numpy(a.copy()), (0, -1)).rel if subnormal else 0.0
    finite = np.isfinite(a)
    peak = float(np.abs(a[finite]).max()) if finite.any() else 0.0
    return RangeIssues(peak, int((finite & ~np.isfinite(h)).sum()), subnormal, zeroed, lost)


SATURATED = 1e30
"""Finite constants at or beyond this are masking constants (torch.finfo(float32).min)."""


def clamp_mask_constants(array: np.ndarray) -> tuple[np.ndarray, int]:
    """Clamp finite |v| >= 1e30 (masking constants) to +-65504, the FP16 equivalent of
    torch.finfo(float16).min that a .half() model would use; inf stays inf."""
    a = np.asarray(array)
    if not np.issubdtype(a.dtype, np.floating) or a.size == 0:
        return a, 0
    huge = np.isfinite(a) & (np.abs(a) >= SATURATED)
    n = int(huge.sum())
    if not n:
        return a, 0
    return np.where(huge, np.sign(a) * 65504.0, a).astype(a.dtype), n


def keep_fp32(nodes: bool) -> str:
    """How the user keeps what fails in FP16 or INT8 in FP32: the nodes of an ONNX source
    (``nodes``: one without fp16lens's module map, where a site is a node name), else the
    modules of the PyTorch model they come from."""
    if nodes:
        return "keep those nodes FP32 (export(..., fp32_nodes=[...]))"
    return "keep those modules FP32 (export(..., fp32_modules=[...]))"


def to_fp16_checked(
    name: str, array: np.ndarray, modules: list[str], readers: Sequence[str] = ()
) -> tuple[np.ndarray, RangeIssues]:
    """``array`` as float16 and what the conversion does to it; ExportError on overflow,
    naming the ``modules`` it belongs to, else (an ONNX source) the nodes that read it.

    Masking constants (finite values >= 1e30, such as finfo(float32).min) are clamped to
    +-65504 rather than refused: converted as they are they would become inf, and
    ``(1 - mask) * -inf`` is NaN where the mask is 1."""
    array, _ = clamp_mask_constants(array)
    issues = range_issues(array)
    if issues.overflow:
        kind, names = ("module", modules) if modules or not readers else ("node", readers)
        where = ", ".join(map(repr, names)) or "the model"
        raise ExportError(
            f"weight {name!r} of {where} holds {issues.overflow} value(s) beyond FP16 "
            f"(|max| = {issues.absmax:.4g} > 65504). Rescale it with fp16lens.patch(), or keep "
            f"the {kind} in FP32: export(..., fp32_{kind}s=[{', '.join(map(repr, names))}])."
        )
    return np.asarray(array).astype(np.float16), issues


def _parts(hit: list, shown: int) -> str:
    hit = sorted(hit, key=lambda e: e[2].subnormal / max(e[1], 1), reverse=True)
    parts = [
        f"{n} ({i.subnormal} of {size} values subnormal, {i.zeroed or 'none'} of them 0 in FP16)"
        for n, size, i, _ in hit[:shown]
    ]
    return ", ".join(parts) + (f", and {len(hit) - shown} more" if len(hit) > shown else "")


MAY_CHANGE = "which may change the output"
"""The words of the subnormal warning where a weight's loss may matter; the export's FP16
check says next to them what it saw on its inputs."""


def harmless(issues: RangeIssues, additive: bool) -> bool:
    """The rule watch applies, without the activations: a bias loses less than 2^-25 per
    value, below half an FP16 step of any value it is added to; a weight is harmless when
    every output channel loses at most 2^-11 of its sum |w| (FP16's rounding of the rest)."""
    return additive or issues.lost_rel <= REL_STEP


def subnormal_summary(
    entries: list[tuple[str, int, RangeIssues, bool]], shown: int = 5, *, nodes: bool = False
) -> str | None:
    """One warning for all weights with subnormal values, (name, size, issues, additive):
    whether their loss matters, judged by ``harmless``, and what to do where it does
    (``keep_fp32(nodes)`` among it)."""
    hit = [e for e in entries if e[2].subnormal]
    if not hit:
        return None
    total = sum(i.subnormal for _, _, i, _ in hit)
    zeroed = sum(i.zeroed for _, _, i, _ in hit)
    head = (
        f"{len(hit)} weight(s) hold {total} value(s) that are subnormal in FP16 (< 2^-14, "
        f"reduced precision; {zeroed} round to 0)"
    )
    matter = [e for e in hit if not harmless(e[2], e[3])]
    if not matter:
        return (
            f"{head}; their loss is below the output precision of their layers (a bias loses "
            "< 2^-25 per value; no output channel of a weight loses more than 2^-11 of its "
            f"magnitude, FP16's own rounding): harmless: {_parts(hit, shown)}"
        )
    worst = max(e[2].lost_rel for e in matter)
    rest = len(hit) - len(matter)
    return (
        f"{head}. In {len(matter)} of them an output channel loses up to {percent(worst)} of its "
        f"weight magnitude, more than FP16's own rounding (2^-11), {MAY_CHANGE}: "
        f"{_parts(matter, shown)}; check parity (fp16lens.verify(..., backend='onnx-fp16')) and "
        "where it drops, scale that weight up by 2^k and the next layer down by 2^-k, or "
        + keep_fp32(nodes)
        + (
            f"; the other {rest} lose less than the output precision of their layers: harmless"
            if rest
            else ""
        )
    )


def vanished_guard(array: np.ndarray, readers: list) -> str | None:
    """Words for an eps or clip bound that FP16 makes 0 (a positive scalar that
    ``_core.underflow.flushes``, read only by ``ONNX_GUARDS`` ops): ``F.normalize``'s
    1e-12, a pooling's ``clamp(min=1e-9)``. Without it, an input that makes the guarded
    values 0 (a zero vector, an all-padding mask, digital silence) divides 0 by 0. None
    otherwise."""
    if np.size(array) != 1 or not readers:
        return None
    value = float(np.asarray(array).reshape(-1)[0])
    if value <= 0 or not flushes(value):
        return None
    if not all(n.op_type in ONNX_GUARDS for n in readers):
        return None
    return f"{value:.3g}, 0 in FP16"


def guards_summary(guards: list[str], *, nodes: bool = False) -> str:
    """One warning for every eps or clip bound FP16 makes 0 (``vanished_guard``), with
    ``keep_fp32(nodes)`` among the fixes."""
    return (
        f"{len(guards)} eps or clip bound(s) below 2^-25 are 0 in FP16, so they no longer "
        f"keep values off 0: {'; '.join(guards)}. Where an input makes the values they guard "
        "0 (a zero vector, an all-padding mask, digital silence), a divide, log or rsqrt "
        "after them gives inf/NaN in FP16 where FP32 is finite; use a bound FP16 holds (at "
        "least 6.1e-05, e.g. F.normalize(x, eps=1e-4)) or " + keep_fp32(nodes)
    )
