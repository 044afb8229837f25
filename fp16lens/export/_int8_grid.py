"""An input on an 8-bit grid, encoded in INT8 exactly.

An image reaches a network as 8-bit pixels normalized per channel, ``x = (p / 255 - m) / s``:
at most 256 evenly spaced values per channel. A per-tensor INT8 scale set by the largest
channel's range puts its levels elsewhere, so every pixel is rounded (PP-OCRv4's detector
reads steps of 0.0171 through a grid of 0.0208) and MTCNN's ``(p - 127.5) / 128`` is
clipped by a percentile range. Where the calibration batches show such a grid, each channel
is moved onto the INT8 codes themselves and the inverse goes into the convs that read it:

    x' = x / step_c + b_c   (integers in [-128, 127], INT8 scale 1: no rounding at all)
    W' = W · diag(step_c),  bias' = bias - W' · b_c

TensorRT's Q layer clamps activations to [-128, 127], so all 256 levels fit. A conv with
padding gets its zeros from an explicit ``Pad`` before the encoding, the conv itself then
unpadded (the border's zeros, ``b_c`` once encoded, are the only values rounded). Exact in
real arithmetic; in FP32 the rounding of the new constants (checked against ``EXACT`` of
the outputs' norm, else nothing moves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

LEVELS = 256  # codes in [-128, 127]
GRID_TOL = 1e-3  # of a step: how far from the grid a value may lie (FP32 normalization)
MIN_VALUES = 1024  # per channel: fewer cannot show a grid


@dataclass(frozen=True)
class Grid:
    """The graph input ``source`` read by the conv ``reader`` through the encoded tensor
    ``tensor`` (INT8 scale 1); per channel ``step`` and the code ``offset`` of its value 0."""

    source: str
    tensor: str
    reader: str
    step: tuple[float, ...]
    offset: tuple[float, ...]
    amax: float  # the largest |x| of the source on the calibration batches (TensorRT 10 cache)


def channel_grid(v: np.ndarray) -> tuple[float, float] | None:
    """(step, code of the value 0) of a channel holding <= 256 evenly spaced values; None
    where the values are not such a grid. The codes sit as symmetric INT8 puts them, the
    value 0 nearest the middle of [-128, 127] (normalization centres the pixels on 0:
    MTCNN's ``(p - 127.5) / 128`` becomes ``p - 128``, all 256 levels), moved only as far
    as the values seen need to fit."""
    if v.size < MIN_VALUES:
        return None
    u = np.unique(v.astype(np.float64))
    if not 2 <= u.size <= LEVELS:
        return None
    span = round(float((u[-1] - u[0]) / np.diff(u).min()))
    if span > LEVELS - 1:
        return None
    step = float(u[-1] - u[0]) / span  # the whole span: each difference carries FP32 rounding
    k = (u - u[0]) / step
    if np.abs(k - np.rint(k)).max() > GRID_TOL:
        return None
    low = u[0] / step  # the lowest value's code, less the offset
    r = (-low) % 1.0
    offset = r + round(-0.5 - r)  # codes on integers, the value 0 nearest -0.5
    lo = round(low + offset)  # the lowest value's code
    offset += max(0, -128 - lo) - max(0, lo + span - 127)  # the values seen fit
    return step, float(offset)


def input_grid(values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, float] | None:
    """(steps, codes of the value 0, max |x|) of an input's batches whose every channel
    (axis 1) holds an 8-bit grid (``channel_grid``); None otherwise."""
    if not values or any(v.ndim < 3 for v in values):
        return None
    chans = np.concatenate([np.moveaxis(v, 1, 0).reshape(v.shape[1], -1) for v in values], axis=1)
    per = [channel_grid(c) for c in chans]
    if any(p is None for p in per):
        return None
    steps, offsets = zip(*per)
    return np.array(steps), np.array(offsets), float(np.abs(chans).max())


def find_grids(graph, units, feeds: list) -> list[tuple[str, str, np.ndarray, np.ndarray, float]]:
    """(input, reader conv, steps, codes of the value 0, max |x|) for every graph input that a
    group-1 Conv reads as data and whose every channel (axis 1) holds an 8-bit grid on
    ``feeds``."""
    from fp16lens.export._int8_equalize import _attr, _index

    consts, _, _, _, nodes = _index(graph)
    inputs = {i.name for i in graph.input} - set(consts)
    found = []
    grids: dict[str, tuple[np.ndarray, np.ndarray, float] | None] = {}
    for u in units:
        node = nodes[u.node]
        if u.op != "Conv" or u.weight is None or u.acts != (node.input[0],):
            continue
        t = u.acts[0]
        attrs = {a.name: a for a in node.attribute}
        if t not in inputs or _attr(node, "group", 1) != 1:
            continue
        if "auto_pad" in attrs and attrs["auto_pad"].s not in (b"NOTSET", b"VALID"):
            continue
        if t not in grids:
            grids[t] = input_grid([np.asarray(f[t]) for f in feeds if t in f])
        grid = grids[t]
        if grid is not None and consts[u.weight].shape[1] == len(grid[0]):
            found.append((t, u.node, *grid))
    return found


def encode(proto, units, feeds: list) -> tuple[Any, list[Grid], float]:
    """A copy of ``proto`` whose grid inputs (``find_grids``) reach their convs encoded on
    the INT8 codes, with the relative output change it makes in FP32 on the first feed.
    Nothing moves (the copy equals ``proto``) where no grid is found or the change exceeds
    ``EXACT``."""
    import onnx
    from onnx import helper, numpy_helper

    from fp16lens.export._int8_equalize import _consts, proven

    found = find_grids(proto.graph, units, feeds)
    if not found:
        return proto, [], 0.0
    consts = _consts(proto.graph)
    moved = onnx.ModelProto()
    moved.CopyFrom(proto)
    g = moved.graph
    by_name = {n.name: n for n in g.node}
    made: dict[str, list] = {}  # reader -> the nodes that encode its input
    grids = []
    for source, reader, step, offset, amax in found:
        conv = by_name[reader]
        w = consts[conv.input[1]].astype(np.float64)
        ndim = w.ndim  # the input's rank: batch, channel, spatial
        shape = (len(step),) + (1,) * (ndim - 2)
        tag = f"{source}__grid_{reader}"
        nodes, x = [], source
        pads = next((list(a.ints) for a in conv.attribute if a.name == "pads"), [])
        if any(pads):  # the conv's zeros made before the encoding, the conv unpadded
            half = len(pads) // 2
            full = [0, 0, *pads[:half], 0, 0, *pads[half:]]
            g.initializer.append(numpy_helper.from_array(np.array(full, np.int64), f"{tag}_pads"))
            nodes.append(helper.make_node("Pad", [x, f"{tag}_pads"], [f"{tag}_padded"]))
            x = f"{tag}_padded"
            for a in conv.attribute:
                if a.name == "pads":
                    del a.ints[:]
                    a.ints.extend([0] * len(pads))
        g.initializer.extend(
            [
                numpy_helper.from_array((1.0 / step).reshape(shape).astype(np.float32), f"{tag}_a"),
                numpy_helper.from_array(offset.reshape(shape).astype(np.float32), f"{tag}_b"),
            ]
        )
        nodes += [
            helper.make_node("Mul", [x, f"{tag}_a"], [f"{tag}_scaled"]),
            helper.make_node("Add", [f"{tag}_scaled", f"{tag}_b"], [tag]),
        ]
        made[reader] = nodes
        new_w = w * step.reshape((1, -1) + (1,) * (ndim - 2))
        bias = -(new_w.reshape(w.shape[0], w.shape[1], -1).sum(axis=2) @ offset)
        if len(conv.input) > 2 and conv.input[2]:
            bias = bias + consts[conv.input[2]].astype(np.float64)
        weight = f"{conv.input[1]}__grid_{reader}"  # a weight two convs share stays theirs
        g.initializer.extend(
            [
                numpy_helper.from_array(new_w.astype(np.float32), weight),
                numpy_helper.from_array(bias.astype(np.float32), f"{reader}__grid_bias"),
            ]
        )
        conv.input[0], conv.input[1] = tag, weight
        if len(conv.input) > 2:
            conv.input[2] = f"{reader}__grid_bias"
        else:
            conv.input.append(f"{reader}__grid_bias")
        grids.append(Grid(source, tag, reader, tuple(step), tuple(offset), amax))
    nodes = []
    for node in g.node:
        nodes += made.get(node.name, [])
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    return proven(proto, moved, grids, feeds)
