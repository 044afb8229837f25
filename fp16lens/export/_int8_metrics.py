"""Task metrics a user can state without an evaluation set, for ``Int8Target``; and the
targets a terminal names (``named_target``: ``fp16lens export --target sqnr=30``).

Both measure how much of FP32's *decision margin* the INT8 graph keeps, item by item or
frame by frame: finer than "the same answer" (which a handful of calibration items shows as
a few coarse steps), and aimed at the decision, where the output cosine weighs every value
alike.

- ``top1_margin``: a classifier's top-1. Per item, FP32's top-1 score over the best other
  class, read in the INT8 output, as a share of the same gap in FP32.
- ``ctc_margin``: a greedy CTC reader's string. Per frame, the best class that leaves the
  FP32 string unchanged (FP32's own class, and where harmless the blank or a neighbouring
  frame's class) over the best class that would change it, read in the INT8 output, as a
  share of the same gap in FP32. A frame where INT8 takes a harmless class (a run of a
  letter one frame shorter) costs nothing; a frame where the string's decision flips
  costs more than its whole margin.

Each returns the mean over items (frames) of that share, clipped to [-1, 1]: 1.0 when
every margin is kept, and a flipped decision costs up to 2 / (number of items). Use as
``Int8Target(0.98, ctc_margin, "CTC margin kept")``; ``functools.partial`` sets ``output``
(which graph output) and ``blank``.

On the outputs themselves, every float output of every batch: ``mean_cosine`` (the
worst cosine is ``Int8Target``'s default) and ``worst_sqnr``, in dB.
"""

from __future__ import annotations

import numpy as np

Outputs = list  # one batch's graph outputs


def _gaps(scores: np.ndarray, good: list[list[int]]) -> np.ndarray:
    """Per row of ``scores`` (rows, classes): the best of the row's ``good`` classes minus
    the best of the others."""
    best = np.array([scores[i, g].max() for i, g in enumerate(good)])
    others = scores.copy()
    for i, g in enumerate(good):
        others[i, g] = -np.inf
    return best - others.max(axis=1)


def _kept(ref_gaps: np.ndarray, out_gaps: np.ndarray) -> float:
    share = out_gaps / np.maximum(ref_gaps, 1e-12)
    return float(np.mean(np.clip(share, -1.0, 1.0)))


def _rows(value, output: int) -> np.ndarray:
    a = np.asarray(value[output], np.float64)
    return a.reshape(-1, a.shape[-1])


def top1_margin(refs: list[Outputs], outs: list[Outputs], *, output: int = 0) -> float:
    """The share of FP32's top-1 margin the INT8 outputs keep, mean over items, clipped to
    [-1, 1] (1.0: every margin kept; below 1 - 2/items: some top-1 has flipped).

    ``refs``/``outs``: per batch, the FP32 and INT8 graph outputs; ``output`` picks the
    scores (batch, classes) or (..., classes): logits or probabilities. An item's margin
    is FP32's top-1 score over its best other class."""
    ref_gaps, out_gaps = [], []
    for ref, out in zip(refs, outs):
        r, o = _rows(ref, output), _rows(out, output)
        good = [[int(c)] for c in r.argmax(axis=1)]
        ref_gaps.append(_gaps(r, good))
        out_gaps.append(_gaps(o, good))
    return _kept(np.concatenate(ref_gaps), np.concatenate(out_gaps))


def _collapse(ids: list[int], blank: int) -> list[int]:
    return [c for k, c in enumerate(ids) if c != blank and (k == 0 or c != ids[k - 1])]


def _harmless(ids: list[int], blank: int) -> list[list[int]]:
    """Per frame, the classes that leave the greedy string unchanged when that frame alone
    takes them: its own, and the blank or a neighbour's class where the collapse absorbs it."""
    string = _collapse(ids, blank)
    good = []
    for t, c in enumerate(ids):
        ok = [c]
        for a in (blank, ids[t - 1] if t else blank, ids[t + 1] if t + 1 < len(ids) else blank):
            if a not in ok and _collapse([*ids[:t], a, *ids[t + 1 :]], blank) == string:
                ok.append(a)
        good.append(ok)
    return good


def ctc_margin(
    refs: list[Outputs], outs: list[Outputs], *, output: int = 0, blank: int = 0
) -> float:
    """The share of FP32's greedy-CTC decision margin the INT8 outputs keep, mean over
    frames, clipped to [-1, 1] (1.0: every margin kept; a frame whose decision flips costs
    more than its own margin).

    ``refs``/``outs``: per batch, the FP32 and INT8 graph outputs; ``output`` picks the
    per-frame scores (batch, frames, classes), probabilities or logits; ``blank`` is the
    CTC blank's class. A frame's margin: the best class that keeps FP32's greedy string
    (FP32's own, and the blank or a neighbour's class where the collapse absorbs it) over
    the best class that would change it."""
    ref_gaps, out_gaps = [], []
    for ref, out in zip(refs, outs):
        r, o = np.asarray(ref[output], np.float64), np.asarray(out[output], np.float64)
        if r.ndim == 2:
            r, o = r[None], o[None]
        for rb, ob in zip(r, o):
            good = _harmless([int(c) for c in rb.argmax(axis=-1)], blank)
            ref_gaps.append(_gaps(rb, good))
            out_gaps.append(_gaps(ob, good))
    return _kept(np.concatenate(ref_gaps), np.concatenate(out_gaps))


def aligned(ref, out) -> tuple[np.ndarray, np.ndarray]:
    """``ref`` and ``out`` as float64 arrays of one shape. Where INT8 changes an output's
    shape (a decoder that stops at another step: SLANet-plus's structure tokens from its
    Loop), each is zero-padded to the larger extent on every axis (flattened first where
    the ranks differ), so what one has and the other lacks counts in full as error."""
    r, o = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    if r.shape == o.shape:
        return r, o
    if r.ndim != o.ndim:
        r, o = r.ravel(), o.ravel()
    shape = np.maximum(r.shape, o.shape)
    r, o = (np.pad(a, [(0, int(s) - n) for s, n in zip(shape, a.shape)]) for a in (r, o))
    return r, o


def _float_pairs(refs: list[Outputs], outs: list[Outputs]):
    for ref, out in zip(refs, outs):
        for r, o in zip(ref, out):
            if np.asarray(r).dtype.kind == "f":
                a, b = aligned(r, o)
                yield a.ravel(), b.ravel()


def mean_cosine(refs: list[Outputs], outs: list[Outputs]) -> float:
    """The output cosine to FP32, mean over batches and float outputs."""
    from fp16lens.export._int8_search import cosine

    values = [cosine(r, o) for r, o in _float_pairs(refs, outs)]
    return float(np.mean(values)) if values else 1.0


def worst_sqnr(refs: list[Outputs], outs: list[Outputs]) -> float:
    """The signal-to-quantization-noise ratio in dB, 10 log10(sum ref^2 / sum (out -
    ref)^2), of the worst batch and float output (inf where INT8 equals FP32)."""
    from fp16lens._core.parity import sqnr_db

    values = [sqnr_db(float(r @ r), float((o - r) @ (o - r))) for r, o in _float_pairs(refs, outs)]
    return min(values) if values else float("inf")


# name -> (metric, what the threshold is, the thresholds that make sense: low < t <= high)
NAMED = {
    "cosine": (None, "worst output cosine", (0.0, 1.0)),
    "mean-cosine": (mean_cosine, "mean output cosine", (0.0, 1.0)),
    "sqnr": (worst_sqnr, "worst output SQNR (dB)", (0.0, 200.0)),
    "top1": (top1_margin, "top-1 margin kept", (-1.0, 1.0)),
    "ctc": (ctc_margin, "CTC margin kept", (-1.0, 1.0)),
}


def named_target(name: str, threshold: float):
    """The ``Int8Target`` a terminal names: ``cosine`` (the worst output cosine),
    ``mean-cosine``, ``sqnr`` (worst, dB), ``top1`` (``top1_margin`` of output 0), ``ctc``
    (``ctc_margin`` of output 0, blank 0); ExportError (one line) for another name or a
    threshold the metric cannot reach."""
    from fp16lens._core import ExportError
    from fp16lens.export._int8_search import Target

    if name not in NAMED:
        raise ExportError(f"no INT8 target named {name!r}; the names are {', '.join(NAMED)}")
    metric, what, (low, high) = NAMED[name]
    if not low < threshold <= high:  # nan fails too
        raise ExportError(f"the {what} target must be in ({low:g}, {high:g}], not {threshold!r}")
    return Target(float(threshold), metric, what)
