"""Weight rounding fitted to the layer's inputs (GPTQ; Frantar et al., 2022).

Per-channel INT8 rounds every weight to its nearest code. That is the least error per
weight, not per output: a conv's output error is ``(W - Ŵ) x``, and where its inputs are
correlated (neighbouring pixels, a pixel's three colours, a depthwise conv's nine taps) the
errors of nearest rounding add up. On EfficientNet-Lite0 the weights' rounding alone costs
more at the output than every activation quantizer together.

For each conv-like node and the Hessian of its layer error on the calibration inputs,
``H = sum x xᵀ`` (one per group; ``x`` the im2col patch), GPTQ quantizes one input column
at a time and spreads each rounding error over the columns not yet quantized, the way the
inverse Hessian says is least costly (Optimal Brain Quantization). The scale stays the one
``quantize_weight`` gives (the channel's max over 127), so the written DequantizeLinear, the
TensorRT 10 cache's weights and TensorRT's own reading of the codes are unchanged in form:
only which integer each weight takes.

``fit`` returns, per weight it could fit, the INT8 codes; the caller keeps them only where
the all-INT8 output error falls on calibration batches it did not fit on. ``folds`` gives
what the search asks for, ``fit`` on each half of the batches (to check the rounding on the
other half) and on all of them, from one pass: each batch's products are made once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp16lens.export._int8_place import Unit

QMAX = 127
DAMP = 0.01  # of the Hessian's mean diagonal, added to its diagonal (GPTQ's default)
BLOCK = 128  # columns quantized before the rest is updated
SAMPLES = 16384  # patch columns kept per batch and node: enough for a 2304-wide Hessian
MAX_INPUTS = 4608  # a 3x3 conv over 512 channels: 170 MB per product
SEED = 0  # of the generator a fit draws its samples of patches from
BUDGET = 1 << 30  # bytes of moments held at once


def _attrs(node) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _patches(node, x: np.ndarray, w_shape: tuple[int, ...]) -> tuple[np.ndarray, int] | None:
    """(columns (groups, K, L), groups) of what ``node`` multiplies its weight with, or None
    where the node's form is not one this fits."""
    import torch

    a = _attrs(node)
    if node.op_type in ("Gemm", "MatMul"):
        if node.op_type == "Gemm" and a.get("transA", 0):
            return None
        return x.reshape(-1, x.shape[-1]).T[None], 1
    if node.op_type != "Conv" or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    if x.ndim == 3:
        x = x[:, :, None, :]
        kernel: tuple[int, ...] = (1, w_shape[2])
        pads = a.get("pads", [0, 0])
        pads = [0, pads[0], 0, pads[1]]
        strides, dilations = [1, *a.get("strides", [1])], [1, *a.get("dilations", [1])]
    elif x.ndim == 4:
        kernel = tuple(w_shape[2:])
        pads = a.get("pads", [0, 0, 0, 0])
        strides, dilations = a.get("strides", [1, 1]), a.get("dilations", [1, 1])
    else:
        return None
    group = a.get("group", 1)
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    t = torch.nn.functional.pad(t, (pads[1], pads[3], pads[0], pads[2]))
    cols = torch.nn.functional.unfold(t, kernel, dilation=dilations, stride=strides)
    n, k, length = cols.shape
    return cols.permute(1, 0, 2).reshape(group, k // group, n * length).numpy(), group


def quantized(x: np.ndarray, scale: float) -> np.ndarray:
    """``x`` through QuantizeLinear and DequantizeLinear (symmetric INT8, zero point 0)."""
    return (np.clip(np.rint(x / np.float32(scale)), -128, 127) * np.float32(scale)).astype(
        np.float32
    )


def _rows(w: np.ndarray, node_op: str, axis: int, groups: int) -> np.ndarray:
    """The weight as (groups, rows per group, K): one row per output channel, its columns
    in the order of the patches."""
    if node_op == "Conv":
        return w.reshape(groups, w.shape[0] // groups, -1)
    return np.moveaxis(w, axis, 0).reshape(1, w.shape[axis], -1)


def _back(q: np.ndarray, w: np.ndarray, node_op: str, axis: int) -> np.ndarray:
    if node_op == "Conv":
        return q.reshape(w.shape)
    moved = np.moveaxis(w, axis, 0).shape
    return np.moveaxis(q.reshape(moved), 0, axis)


def gptq(rows: np.ndarray, scale: np.ndarray, hessian: np.ndarray) -> np.ndarray:
    """INT8 codes of ``rows`` (groups, R, K) with per-row ``scale`` (groups, R), fitted to
    ``hessian`` (groups, K, K): one column at a time, each rounding error spread over the
    columns after it by the inverse Hessian's Cholesky factor."""
    import torch

    w = torch.from_numpy(rows.astype(np.float64)).clone()
    s = torch.from_numpy(scale.astype(np.float64))
    h = torch.from_numpy(hessian.astype(np.float64)).clone()
    k = h.shape[-1]
    eye = torch.eye(k, dtype=h.dtype)
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    dead = diag <= 0
    h = h + eye * dead.unsqueeze(-1).to(h.dtype)  # a column no input reaches: nearest
    damp = DAMP * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)
    h = h + damp[:, None, None] * eye
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    # the column loop in NumPy on the rows transposed, a column a contiguous row (a small
    # array's op costs less than torch's; the same IEEE arithmetic), the block update by
    # torch's matmul of the same operands as before: the same codes as the loop in torch
    # (scripts/bench_int8_round.py times the two)
    wt = np.ascontiguousarray(w.numpy().transpose(0, 2, 1))  # (groups, K, R)
    sn, un = s.numpy(), u.numpy()
    q = np.empty_like(wt)
    for start in range(0, k, BLOCK):  # GPTQ's lazy batches: the rest updated once a block
        end = min(start + BLOCK, k)
        errs = np.empty((wt.shape[0], end - start, wt.shape[2]))
        for i in range(start, end):
            col = wt[:, i, :]
            qi = np.clip(np.round(col / sn), -QMAX, QMAX)
            q[:, i, :] = qi
            err = (col - qi * sn) / un[:, i, i][:, None]
            errs[:, i - start, :] = err
            wt[:, i + 1 : end, :] -= un[:, i, i + 1 : end, None] * err[:, None, :]
        if end < k:
            update = torch.from_numpy(errs).transpose(1, 2) @ u[:, start:end, end:]
            wt[:, end:, :] -= update.numpy().transpose(0, 2, 1)
    return q.transpose(0, 2, 1).astype(np.int8)


@dataclass
class Moments:
    """A layer's input products over some calibration batches, per group: ``xx = X Xᵀ``,
    ``qx = X̂ Xᵀ``, ``qq = X̂ X̂ᵀ`` (``X`` the FP32 patches, ``X̂`` them quantized)."""

    xx: np.ndarray
    qx: np.ndarray
    qq: np.ndarray

    def __iadd__(self, other: Moments) -> Moments:
        self.xx += other.xx
        self.qx += other.qx
        self.qq += other.qq
        return self

    def error(self, w: np.ndarray, w_hat: np.ndarray) -> float:
        """``sum |W x - Ŵ x̂|²`` over these inputs (``w``, ``w_hat``: (groups, R, K))."""
        w, w_hat = w.astype(np.float64), w_hat.astype(np.float64)
        return float(
            np.sum((w @ self.xx) * w)
            - 2 * np.sum((w_hat @ self.qx) * w)
            + np.sum((w_hat @ self.qq) * w_hat)
        )


def _inputs(u: Unit, shape: tuple[int, ...], node) -> tuple[int, int]:
    """(groups, inputs per output) of the unit's weight: the Hessian's size."""
    if u.op == "Conv":
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        return group, int(np.prod(shape[1:]))
    axis = u.axis if u.axis is not None else 0
    return 1, int(np.prod(shape)) // shape[axis]


def moment_bytes(u: Unit, shape: tuple[int, ...], node, parts: int = 2) -> int | None:
    """Bytes of the unit's moments (``parts`` sums of three float64 products), or None where
    its weight is wider than ``MAX_INPUTS`` (left to the nearest rounding)."""
    g, k = _inputs(u, shape, node)
    return None if k > MAX_INPUTS else parts * 3 * g * k * k * 8


def _passes(todo: list[Unit], shapes: dict, nodes: dict, parts: int) -> list[list[Unit]]:
    """``todo`` in runs whose moments (``parts`` sums each) fit in ``BUDGET`` bytes
    together: one pass over the calibration batches each. A weight wider than
    ``MAX_INPUTS`` is left to the nearest rounding."""
    runs: list[list[Unit]] = [[]]
    used = 0
    for u in todo:
        size = moment_bytes(u, shapes[u.weight], nodes[u.node], parts)
        if size is None:
            continue
        if runs[-1] and used + size > BUDGET:
            runs.append([])
            used = 0
        runs[-1].append(u)
        used += size
    return [r for r in runs if r]


def _products(cols: np.ndarray, scale: float, rng) -> Moments:
    """One batch's ``Moments`` of a layer's patches ``cols`` (groups, K, N), at most
    ``SAMPLES`` of them drawn at random; its float64 copies die with the call."""
    if cols.shape[-1] > SAMPLES:
        keep = np.sort(rng.choice(cols.shape[-1], SAMPLES, replace=False))
        cols = cols[..., keep]
    # im2col copies values and pads zeros, which INT8 keeps: quantizing the patches is
    # quantizing the input
    c, q = cols.astype(np.float64), quantized(cols, scale).astype(np.float64)
    ct = c.transpose(0, 2, 1)
    return Moments(c @ ct, q @ ct, q @ q.transpose(0, 2, 1))  # BLAS: einsum would not use it


def _take(sess, feed, batch: list[Unit], graph: tuple, at: tuple, into: tuple) -> None:
    """One calibration batch's ``Moments`` of each unit of ``batch`` (``graph``: nodes,
    weight shapes, scales) added to ``into`` (parts, groups, skipped, the generator of the
    samples, the set of units whose patches would be sampled, or None to sample them) at
    ``at`` (the batch's part, whether the part starts with it); a function, so its arrays
    die with the call rather than be held while the next pass makes its own."""
    from fp16lens.export._int8_search import _run_all

    nodes, shapes, scales = graph
    part, first = at
    parts, groups, skip, rng, sampled = into
    values = _run_all(sess, feed, list(dict.fromkeys(u.acts[0] for u in batch)))
    for u in batch:
        x = values.get(u.acts[0])
        got = None if u.node in skip or x is None else _patches(nodes[u.node], x, shapes[u.weight])
        if got is not None and sampled is not None and got[0].shape[-1] > SAMPLES:
            sampled.add(u.node)
            got = None
        if got is None:
            skip.add(u.node)
            continue
        cols, groups[u.node] = got
        m = _products(cols, scales[u.acts[0]], rng)
        if first:
            parts[u.node][part] = m
        else:
            parts[u.node][part] += m  # in place: no third copy of the sums


def fittable(proto, units: Sequence[Unit], scales: dict) -> list[Unit]:
    """The units whose weight the fit can take: a Conv/Gemm/MatMul weight per channel, in
    the graph's initializers, read by that unit alone, with one quantized input."""
    inits = {i.name for i in proto.graph.initializer}
    readers: dict[str, int] = {}
    for u in units:
        if u.weight is not None:
            readers[u.weight] = readers.get(u.weight, 0) + 1
    return [
        u
        for u in units
        if u.weight is not None
        and u.axis is not None
        and u.op in ("Conv", "Gemm", "MatMul")
        and readers[u.weight] == 1
        and len(u.acts) == 1
        and u.acts[0] in scales
        and u.weight in inits
    ]


def _halves(batches: list[int]) -> list[list[int]]:
    """``batches`` as the fit splits them to check itself: two halves, or one batch."""
    half = max(1, len(batches) // 2)
    return [batches[:half], batches[half:]] if len(batches) > 1 else [batches]


def _todo(proto, units: Sequence[Unit], scales: dict) -> tuple[list[Unit], dict, dict]:
    """(the units the fit takes, their weights' shapes, the graph's nodes by name)."""
    inits = {i.name: i for i in proto.graph.initializer}
    todo = fittable(proto, units, scales)
    shapes = {u.weight: tuple(inits[u.weight].dims) for u in todo}
    return todo, shapes, {n.name: n for n in proto.graph.node}


def moments(
    proto,
    units: Sequence[Unit],
    feeds: list,
    scales: dict,
    split: list[list[int]] | None = None,
    runs: list[list[Unit]] | None = None,
    sampled: set[str] | None = None,
):
    """Per pass (``runs``, by default ``_passes``): (the units it can fit, their FP32
    weights, per unit node its ``Moments`` on each part of ``split`` (lists of indices into
    ``feeds``, each batch in one part; by default the halves ``fit`` checks itself on), its
    groups). A layer with more than ``SAMPLES`` patches in a batch has them sampled, by one
    generator over the passes in turn; with a ``sampled`` set it is added there instead
    and not fitted. A generator: a pass's moments (up to ``BUDGET`` bytes) can be dropped
    before the next pass makes its own, so the fit holds one pass at a time, not every
    layer's (easyocr CRAFT's 512-channel 3x3 convs hold 1 GB each)."""
    from onnx import numpy_helper

    from fp16lens.export._int8_search import _exposed, session

    inits = {i.name: i for i in proto.graph.initializer}
    todo, shapes, nodes = _todo(proto, units, scales)
    split = _halves(list(range(len(feeds)))) if split is None else split
    where = {n: (k, n == part[0]) for k, part in enumerate(split) for n in part}
    rng = np.random.default_rng(SEED)
    if runs is None:
        runs = _passes(todo, shapes, nodes, max(2, len(split)))  # a fit holds two halves
    for batch in runs:
        if not batch:
            continue
        parts: dict[str, list[Any]] = {u.node: [None] * len(split) for u in batch}
        groups: dict[str, int] = {}
        skip: set[str] = set()
        sess = session(_exposed(proto, list(dict.fromkeys(u.acts[0] for u in batch))))
        for n in sorted(where):
            into = (parts, groups, skip, rng, sampled)
            _take(sess, feeds[n], batch, (nodes, shapes, scales), where[n], into)
        del sess
        fitted = [u for u in batch if u.node not in skip]
        weights = {
            u.weight: numpy_helper.to_array(inits[u.weight]).astype(np.float32) for u in fitted
        }
        yield fitted, weights, parts, groups


def _solve(rows: np.ndarray, scale: np.ndarray, m: Moments) -> np.ndarray:
    """Codes ``Ŵ`` for ``min |W X - Ŵ X̂|²``: the real least squares ``W* = W + W (X - X̂)
    X̂ᵀ (X̂ X̂ᵀ)⁻¹`` (damped towards ``W``: a damping towards 0 would take a high-frequency
    filter's response off with the noise), rounded by GPTQ on ``X̂ X̂ᵀ``."""
    k = m.qq.shape[-1]
    w = rows.astype(np.float64)
    qq = m.qq + np.eye(k) * (DAMP * np.diagonal(m.qq, axis1=-2, axis2=-1).mean(-1))[:, None, None]
    qq = qq + np.eye(k) * (np.diagonal(qq, axis1=-2, axis2=-1) <= 0)[:, :, None]
    # (X̂ X̂ᵀ) Δᵀ = (X̂ Xᵀ - X̂ X̂ᵀ) Wᵀ
    delta = np.linalg.solve(qq, (m.qx - m.qq) @ w.transpose(0, 2, 1))
    return gptq(w + np.moveaxis(delta, -1, -2), scale, m.qq)


def fit(
    proto, units: Sequence[Unit], feeds: list, scales: dict, runs: list[list[Unit]] | None = None
) -> dict[str, np.ndarray]:
    """Per weight (read by one unit only) its fitted INT8 codes, for its layer's output on
    the inputs it reads over ``feeds`` quantized with ``scales`` (activation tensor ->
    scale) against the FP32 output, over the passes ``runs`` where given (``moments``). A
    weight keeps its nearest rounding unless codes fitted on each half of ``feeds`` cost its
    layer less than the nearest on the other half (a deep layer of a small image sees few
    patches, and a fit to few overfits them)."""
    codes = {}
    for fitted, weights, parts, groups in moments(proto, units, feeds, scales, runs=runs):
        for u in fitted:
            layer = _Layer.of(u, weights[u.weight], groups[u.node], parts[u.node])
            got = None if layer is None else layer.nested([parts[u.node]])[0]
            if layer is not None and got is not None:
                codes[u.weight] = layer.back(got)
        del fitted, weights, parts, groups  # this pass's moments, before the next is made
    return codes


def folds(
    proto, units: Sequence[Unit], feeds: list, scales: dict
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``fit`` on the first half of ``feeds``, on the second and on all of them, the codes
    three calls give, from one pass over the batches: each batch's products are made once
    into the quarter it lies in, and the codes fitted on a half (its two quarters summed)
    are the whole fit's check of that half. A layer whose patches ``fit`` samples (more
    than ``SAMPLES`` in a batch) is fitted as the three calls fit it, each drawing its
    samples in turn over the passes a call makes, so that its codes are theirs too; so is
    a layer whose four quarters alone would pass ``BUDGET`` (easyocr CRAFT's 3x3 convs over
    512 channels: 2 GB), so that the fit holds at most what ``fit`` holds."""
    tops = _halves(list(range(len(feeds))))
    if len(tops) < 2:
        raise ValueError("folds needs two calibration batches or more")
    trees = [_halves(t) for t in tops]
    split = [leaf for tree in trees for leaf in tree]
    out: list[dict[str, np.ndarray]] = [{}, {}, {}]
    todo, shapes, nodes = _todo(proto, units, scales)
    # a layer whose quarters alone pass the budget is fitted as the three calls fit it,
    # two halves at a time: the fit holds no more than ``fit`` did
    alone = {
        u.node
        for u in todo
        if (moment_bytes(u, shapes[u.weight], nodes[u.node], len(split)) or 0) > BUDGET
    }
    runs = [[u for u in r if u.node not in alone] for r in _passes(todo, shapes, nodes, len(split))]
    sampled: set[str] = set()
    for fitted, weights, parts, groups in moments(
        proto, units, feeds, scales, split, runs, sampled
    ):
        for u in fitted:
            layer = _Layer.of(u, weights[u.weight], groups[u.node], parts[u.node])
            if layer is None:
                continue
            got = iter(parts[u.node])
            for k, codes in enumerate(layer.nested([[next(got) for _ in t] for t in trees])):
                if codes is not None:
                    out[k][u.weight] = layer.back(codes)
        del fitted, weights, parts, groups  # this pass's moments, before the next is made
    if sampled or alone:
        apart = sampled | alone
        runs = [[u for u in run if u.node in apart] for run in _passes(todo, shapes, nodes, 2)]
        for k, part in enumerate((*tops, tops[0] + tops[1])):
            out[k].update(fit(proto, units, [feeds[i] for i in part], scales, runs))
    return out[0], out[1], out[2]


@dataclass
class _Layer:
    """One weight as the fit solves it: its rows (groups, R, K), their scales, the nearest
    rounding dequantized."""

    u: Unit
    w: np.ndarray
    rows: np.ndarray
    scale: np.ndarray
    near: np.ndarray

    @classmethod
    def of(cls, u: Unit, w: np.ndarray, g: int, parts: list[Moments]) -> _Layer | None:
        """None where its stored weight is exact on a coarse grid (``exact_levels``: not
        one to fit on), or its rows are not as wide as the patches (``parts``)."""
        from fp16lens.export._int8_search import QMAX, quantize_weight, weight_levels

        assert u.weight is not None and u.axis is not None  # moments() fits only these
        rows = _rows(w, u.op, u.axis, g)
        if rows.shape[-1] != parts[0].xx.shape[-1] or (weight_levels(w, u.axis) < QMAX).all():
            return None
        nearest, scale = quantize_weight(w, u.axis)
        scale = scale.reshape(g, -1)
        near = _rows(nearest, u.op, u.axis, g) * scale[..., None].astype(np.float64)
        return cls(u, w, rows, scale, near)

    def solve(self, m: Moments) -> np.ndarray:
        return _solve(self.rows, self.scale, m)

    def held(self, halves: list[Moments], solved: dict[int, np.ndarray]) -> bool:
        """Whether codes fitted on each half cost less on the other half than the nearest
        (always with one half); ``solved``: the halves' codes, filled as they are made."""
        if len(halves) == 1:
            return True
        for k, check in ((0, halves[1]), (1, halves[0])):
            if k not in solved:
                solved[k] = self.solve(halves[k])
            if not check.error(self.rows, solved[k] * self.scale[..., None]) < check.error(
                self.rows, self.near
            ):
                return False
        return True

    def nested(self, trees: list[list[Moments]]) -> list[np.ndarray | None]:
        """The codes of each tree of parts (one or two) that passes ``held`` on them and,
        with two trees, of them all where the trees' sums pass it: None where not. The
        parts are summed in place, the first into each tree's, the trees into the first."""
        if len(trees) == 1:
            (parts,) = trees
            if not self.held(parts, {}):
                return [None]
            return [self.solve(self._sum(parts))]
        sums, codes, ok = [], [], []
        for parts in trees:
            ok.append(self.held(parts, {}))
            sums.append(self._sum(parts))
            codes.append(self.solve(sums[-1]))  # the whole's check needs it either way
        whole = self.held(sums, dict(enumerate(codes)))
        kept: list[np.ndarray | None] = [c if good else None for c, good in zip(codes, ok)]
        return [*kept, self.solve(self._sum(sums)) if whole else None]

    @staticmethod
    def _sum(parts: list[Moments]) -> Moments:
        total = parts[0]
        for m in parts[1:]:
            total += m  # in place: the parts are not read again
        return total

    def back(self, codes: np.ndarray) -> np.ndarray:
        assert self.u.axis is not None
        return _back(codes, self.w, self.u.op, self.u.axis)
