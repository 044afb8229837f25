"""Per-channel scale migration into the affine op before a quantized input: exact in FP32.

A conv-like node quantizes its activation input per tensor: one INT8 step for every
channel. When one channel spans 105 and the median one 6 (PP-OCRv4's detector, behind its
first hardswishes), the small channels keep a few levels. Where the input is made by a
per-channel affine op read by nothing else, the channel's scale can move from the input
into the weights, as SmoothQuant (Xiao et al., 2023) and cross-layer equalization (Nagel et
al., 2019) do, and nothing changes in FP32:

    y = W · x,  x = a ⊙ h + b   ->   x' = x / s = (a / s) ⊙ h + b / s,   W' = W · diag(s)

The affine ops that take the division exactly: ``BatchNormalization`` (scale and bias),
``LayerNormalization`` over the last axis (gamma and beta: a transformer block's norm
before its QKV or MLP projection, one node in every opset-17 export from PyTorch), ``Mul``
by a constant and ``Add`` of a constant after it (PaddlePaddle's learnable affine blocks
and a decomposed LayerNorm's gamma and beta, per-tensor constants turned per channel). The
readers: Conv (the input channel is the weight's axis 1, or axis 0 of a depthwise conv),
MatMul with a 2-D constant weight (its rows) and Gemm (its rows, or its columns with
``transB``); a tensor read by several of them (a norm before separate query, key and
value projections) moves once, every reader's weights taking the product; a Transpose
that keeps the last axis last between the norm and its reader passes the channels as
they are. A depthwise conv's weights are
quantized per output channel = input channel, so the division costs its weights nothing:
each input channel is stretched to the tensor's full range (``s = r_c / r_max``). A full
conv or MatMul shares its weights' quantization over input channels: ``s = sqrt(r_c /
w_c)`` (SmoothQuant's alpha 0.5), the activation and weight ranges met halfway.

``equalize`` returns the rewritten copy and the pairs it changed; the caller proves it
exact (``ensure_exact``) and keeps a pair only where the INT8 error it measures falls.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np

S_CLIP = 1e-3  # the widest scale ratio moved: a near-dead channel is not blown up


@dataclass(frozen=True)
class Pair:
    """An affine ``producer`` (its op and constants) and the conv-like ``reader`` of its
    output ``tensor``, whose input channels lie on ``axis`` of that tensor."""

    tensor: str
    reader: str
    producer: str
    consts: tuple[str, ...]  # the producer's constants divided by s (names in the graph)
    weight: str
    weight_axis: int  # the weight's input-channel axis
    depthwise: bool
    axis: int  # the channel axis of ``tensor``
    # further readers of ``tensor`` (reader, weight, weight_axis): a norm before separate
    # query, key and value projections; one division for all, each weight takes it
    more: tuple[tuple[str, str, int], ...] = ()

    def weights(self) -> list[tuple[str, str, int]]:
        """(reader, weight, input-channel axis) of every reader."""
        return [(self.reader, self.weight, self.weight_axis), *self.more]


def _consts(graph) -> dict:
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i) for i in graph.initializer}


def _attr(node, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _index(graph):
    """What the finders look up: constants, each tensor's producer and readers, the graph
    outputs, and the nodes by name."""
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    outputs = {o.name for o in graph.output}
    return _consts(graph), producer, readers, outputs, {n.name: n for n in graph.node}


def find_pairs(graph, units, skip: AbstractSet[str] = frozenset()) -> list[Pair]:
    """Every (affine producer, conv-like reader) pair of ``graph`` whose scale can move
    (not into the tensors in ``skip``)."""
    consts, producer, readers, outputs, nodes = _index(graph)
    by_tensor: dict[str, list] = {}
    for u in units:
        if u.op in ("Conv", "MatMul", "Gemm") and u.weight is not None and len(u.acts) == 1:
            by_tensor.setdefault(u.acts[0], []).append(u)
    pairs = []
    for t, users in by_tensor.items():
        if t in skip or t in outputs or t not in producer:
            continue
        if len(readers.get(t, ())) != len(users):  # a reader that is not a unit: no move
            continue
        reads = [r for u in users if (r := _reads(nodes[u.node], u, consts[u.weight]))]
        if len(reads) != len(users) or len({r[:3] for r in reads}) != 1:
            continue  # every reader takes the division the same way, or none does
        channels, depthwise, axis, w_axis = reads[0]
        if depthwise and len(users) > 1:
            continue  # a depthwise conv's powers of two are its own
        found = _affine(producer[t], producer, readers, consts, outputs, channels, axis)
        if found is None:
            continue
        first, rest = users[0], zip(users[1:], reads[1:])
        more = tuple((u.node, str(u.weight), r[3]) for u, r in rest)
        pairs.append(
            Pair(
                t, first.node, found[0], found[1], str(first.weight), w_axis, depthwise, axis, more
            )
        )
    return pairs


def _reads(node, unit, w: np.ndarray) -> tuple[int, bool, int, int] | None:
    """How the conv-like ``node`` (``unit``) reads its input against its weight ``w``:
    (input channels, depthwise, the channel axis of the input, the weight's input-channel
    axis); None where a per-channel division of the input cannot move into ``w``."""
    if node.op_type == "Conv":
        group = _attr(node, "group", 1)
        channels = w.shape[1] * group
        depthwise = group > 1 and group == w.shape[0] == channels and w.shape[1] == 1
        if group > 1 and not depthwise:
            return None
        return channels, depthwise, 1, 0 if depthwise else 1
    # x · W (MatMul, Gemm), or x · W^T (Gemm's transB): x's last axis, and the weight's
    # input channels on the axis its per-channel quantization (``unit.axis``) is not
    if w.ndim != 2 or unit.axis is None or node.input[0] != unit.acts[0]:
        return None
    if _attr(node, "transA", 0):
        return None
    w_axis = 1 - unit.axis
    return w.shape[w_axis], False, -1, w_axis


def _per_channel_ok(value: np.ndarray, channels: int, axis: int) -> bool:
    """A constant that broadcasts per tensor or along ``axis`` only."""
    if value.size == 1:
        return True
    shape = value.shape
    if axis == -1:
        return shape[-1] == channels and value.size == channels
    return len(shape) >= 3 and shape[-3] == channels and value.size == channels


def _affine(node, producer, readers, consts, outputs, channels, axis):
    """(producer name, its constants to divide) when ``node`` is an affine op the scale
    passes exactly, else None."""
    if node.op_type == "BatchNormalization" and axis == 1:
        scale, bias = node.input[1], node.input[2]
        return (node.name, (scale, bias)) if scale in consts and bias in consts else None
    if node.op_type == "LayerNormalization" and axis == -1 and _attr(node, "axis", -1) == -1:
        # normalized over the last axis alone: its gamma and beta are per channel there
        gamma_beta = tuple(t for t in node.input[1:3] if t)
        ok = all(t in consts and consts[t].shape == (channels,) for t in gamma_beta)
        return (node.name, gamma_beta) if ok else None
    if node.op_type == "Transpose" and axis == -1:
        # a permutation that keeps the last axis last carries each channel as it is
        # (nn.MultiheadAttention with batch_first, between its norm and its projection)
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [])
        src = node.input[0]
        before = producer.get(src)
        if not perm or perm[-1] != len(perm) - 1 or before is None or before.op_type == "Transpose":
            return None
        if src in outputs or len(readers.get(src, ())) != 1:
            return None
        return _affine(before, producer, readers, consts, outputs, channels, axis)
    if node.op_type == "Mul":
        c = [t for t in node.input if t in consts]
        if len(c) == 1 and _per_channel_ok(consts[c[0]], channels, axis):
            return node.name, (c[0],)
        return None
    if node.op_type == "Add":
        c = [t for t in node.input if t in consts]
        other = [t for t in node.input if t not in consts]
        if len(c) != 1 or len(other) != 1 or not _per_channel_ok(consts[c[0]], channels, axis):
            return None
        mul = producer.get(other[0])
        if mul is None or other[0] in outputs or len(readers.get(other[0], ())) != 1:
            return None
        inner = _affine(mul, producer, readers, consts, outputs, channels, axis)
        if inner is None or mul.op_type == "Add":
            return None
        return node.name, (*inner[1], c[0])
    return None


def channel_ranges(values: list[np.ndarray], axis: int) -> np.ndarray:
    """Per channel, the largest |x| over ``values``."""
    return np.max(
        [np.abs(np.moveaxis(v, axis, 0).reshape(v.shape[axis], -1)).max(axis=1) for v in values],
        axis=0,
    )


def weight_ranges(pair: Pair, consts: dict) -> np.ndarray:
    """Per input channel, the largest |w| over the pair's readers' weights."""
    return np.max(
        [
            np.abs(np.moveaxis(consts[w], axis, 0).reshape(consts[w].shape[axis], -1)).max(axis=1)
            for _, w, axis in pair.weights()
        ],
        axis=0,
    )


def scales_for(pair: Pair, x_range: np.ndarray, w_range: np.ndarray) -> np.ndarray:
    """The per-channel divisor ``s`` of the pair's input (its weights multiplied by it).
    For a depthwise conv a power of two: every product ``(w s)(x / s)`` is then the FP32
    product ``w x`` to the bit (as ``patch``'s factors are powers of two for FP16). For a
    full conv or MatMul the SmoothQuant ratio itself: rounded to powers of two it lowered
    the detector's all-INT8 error less (7.4e-2 -> 8.7e-2 rounded, -> 1.5e-2 not), at an
    FP32 change of about 1e-6 of the output's norm, the order of ONNX Runtime's own rounding
    between its fused and unfused graph."""
    r = np.maximum(x_range.astype(np.float64), 1e-12)
    if pair.depthwise:  # no channel past the widest one: s >= r / r_max
        s = 2.0 ** np.ceil(np.log2(np.clip(r / r.max(), S_CLIP, 1.0)))
    else:
        s = np.sqrt(r / np.maximum(w_range, 1e-12))
        s = np.clip(s / s.max(), S_CLIP, 1.0)  # not rounded: measured, rounding costs here
    return s


def apply(proto, pair: Pair, s: np.ndarray, rank: int = 4):
    """Divide the pair's input channels by ``s`` in place (new constants, never a shared
    one changed): the producer's constants by ``s``, the reader's weight by ``1 / s``.
    ``rank``: the rank of the pair's tensor (a channel-first constant broadcasts over the
    axes after the channel: (c, 1) for a Conv1d's, (c, 1, 1) for a Conv2d's)."""
    from onnx import numpy_helper

    g = proto.graph
    consts = _consts(g)
    nodes = {n.name: n for n in g.node}
    c = len(s)
    shape = (c,) if pair.axis == -1 else (c, *(1,) * (rank - 2))
    for name in pair.consts:
        value = consts[name].astype(np.float32)
        if nodes[pair.producer].op_type == "BatchNormalization":
            new = value / s.astype(np.float32)  # its scale and bias are 1-D per channel
        else:
            new = (np.broadcast_to(value.reshape(-1), (c,)) / s).reshape(shape)
        renamed = f"{name}__eq_{pair.reader}"
        g.initializer.append(numpy_helper.from_array(new.astype(np.float32), renamed))
        _rename_input(g, pair, name, renamed)  # in the producer, or the Mul before its Add
    for reader, weight, axis in pair.weights():
        w = consts[weight].astype(np.float64)
        shaped = s.reshape([-1 if a == axis else 1 for a in range(w.ndim)])
        new_w = numpy_helper.from_array((w * shaped).astype(np.float32), f"{weight}__eq")
        g.initializer.append(new_w)
        nodes[reader].input[1] = new_w.name


def _rename_input(g, pair: Pair, old: str, new: str) -> None:
    """The constant ``old`` read by the pair's producer chain (not by anyone else) -> ``new``."""
    producer = {o: n for n in g.node for o in n.output}
    node = producer[pair.tensor]
    for _ in range(3):  # the affine op, the Mul before its Add, a Transpose after it
        for k, t in enumerate(node.input):
            if t == old:
                node.input[k] = new
                return
        nxt = [producer.get(t) for t in node.input if producer.get(t) is not None]
        if not nxt:
            return
        node = nxt[0]


def relative_error(a: list, b: list) -> float:
    """The worst over batches and float outputs of ||a - b|| / ||a||."""
    worst = 0.0
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
            if u.dtype.kind == "f" and u.size:
                worst = max(worst, float(np.linalg.norm(u - v) / max(np.linalg.norm(u), 1e-30)))
    return worst


EXACT = 1e-5  # relative to the outputs' norm: FP32 rounding of the rescaled constants


def proven(proto, moved, found: list, feeds: list) -> tuple[Any, list, float]:
    """(``moved``, ``found``, change) where the rewrite ``moved`` of ``proto`` changes its
    FP32 outputs on the first feed by at most ``EXACT`` of their norm; else (``proto``, [],
    change): nothing moves, as where ``moved`` does not run."""
    from fp16lens.export._int8_search import session

    outs = [o.name for o in proto.graph.output]
    want = [session(proto).run(outs, feeds[0])]
    try:
        change = relative_error(want, [session(moved).run(outs, feeds[0])])
    except Exception:  # a rewrite ONNX Runtime refuses to run is no rewrite: nothing moves
        return proto, [], float("inf")
    return (proto, [], change) if change > EXACT else (moved, found, change)


def equalize(
    proto, units, feeds: list, skip: AbstractSet[str] = frozenset()
) -> tuple[Any, list[Pair], float]:
    """A copy of ``proto`` with every pair's scale moved (``find_pairs``), ranges from
    ``feeds``; with the relative output change it makes in FP32 on the first feed. Nothing
    moved (the copy equals ``proto``) where no pair is found or the change exceeds
    ``EXACT``."""
    import onnx

    from fp16lens.export._int8_search import _exposed, _run_all, session

    pairs = find_pairs(proto.graph, units, skip)
    if not pairs:
        return proto, [], 0.0
    tensors = [p.tensor for p in pairs]
    sess = session(_exposed(proto, tensors))
    values = [_run_all(sess, f, tensors) for f in feeds]
    consts = _consts(proto.graph)
    moved = onnx.ModelProto()
    moved.CopyFrom(proto)
    for p in pairs:
        ranges = channel_ranges([v[p.tensor] for v in values], p.axis)
        rank = values[0][p.tensor].ndim
        apply(moved, p, scales_for(p, ranges, weight_ranges(p, consts)), rank)
    return proven(proto, moved, pairs, feeds)


# ---- centring: a per-channel shift into the affine op before a padless conv -------------


@dataclass(frozen=True)
class Shift:
    """An input of ``reader`` (a group-1 Conv without padding) made by ``producer`` (an Add
    of the constant ``const``, read by nothing else): each channel moved by ``centre``."""

    tensor: str
    reader: str
    producer: str
    const: str
    centre: tuple[float, ...]
    amax: float  # the largest |x| before the shift (for the TensorRT 10 cache)


def find_shifts(graph, units) -> list[tuple[str, str, str, str]]:
    """(tensor, reader, producer, constant) of every conv input that can be centred exactly:
    the reader is a Conv with one group and no padding (a shift of its input is then a
    constant per output channel, folded into its bias), the tensor is made by an Add of a
    per-channel constant and read by nothing else."""
    consts, producer, readers, outputs, nodes = _index(graph)
    found = []
    for u in units:
        if u.op != "Conv" or u.weight is None or len(u.acts) != 1:
            continue
        node, t = nodes[u.node], u.acts[0]
        attrs = {a.name: a for a in node.attribute}
        if _attr(node, "group", 1) != 1 or any(attrs["pads"].ints if "pads" in attrs else ()):
            continue
        if "auto_pad" in attrs and attrs["auto_pad"].s not in (b"NOTSET", b"VALID"):
            continue
        if t in outputs or len(readers.get(t, ())) != 1 or t not in producer:
            continue
        add = producer[t]
        c = [x for x in add.input if x in consts]
        channels = consts[u.weight].shape[1]
        if add.op_type != "Add" or len(c) != 1 or not _per_channel_ok(consts[c[0]], channels, 1):
            continue
        found.append((t, u.node, add.name, c[0]))
    return found


CENTRED = "__ctr_"
"""The mark in the name of each constant and bias ``centre`` writes."""


def centring_adds(graph) -> list[str]:
    """The Adds applying a centring constant (``centre``: ``x - c`` before a conv's
    quantizer) where only QuantizeLinear reads their output. FP16 rounds ``c`` once for
    every value of its channel: a systematic offset on the INT8 grid (up to 3.6 steps on
    PP-OCRv4's recognizer) that the bias correction, measured with ``c`` in FP32, does not
    undo; its file typed FP16 read at cosine 0.9717 with them FP16 and 0.9789 with only
    these constants FP32. Other Adds of a constant are not these: on PP-OCRv5's recognizer
    (no centring) its 29 such Adds kept FP32 read 0.8551 against 0.8635 typed FP16."""
    consts, _, readers, _, _ = _index(graph)
    found = []
    for node in graph.node:
        ops = {r.op_type for r in readers.get(node.output[0], ())}
        marked = [x for x in node.input if x in consts and CENTRED in x]
        if node.op_type == "Add" and len(marked) == 1 and ops == {"QuantizeLinear"}:
            found.append(node.name)
    return found


def centre(proto, units, feeds: list) -> tuple[Any, list[Shift], float]:
    """A copy of ``proto`` whose centrable conv inputs (``find_shifts``) are shifted per
    channel to the middle of their range on ``feeds``: ``x' = x - c`` by the Add's constant,
    and the reader's bias takes ``W · c``. Symmetric INT8 (TensorRT's only kind) spends
    half its levels on nothing when a channel runs from -0.4 to 29 (a hardswish and
    PaddlePaddle's affine after it); centred, the same step covers half the range. Exact in
    real arithmetic; in FP32 the rounding of ``x - c`` (checked: at most ``EXACT`` of the
    outputs' norm, else nothing moves). With the relative output change on the first feed."""
    import onnx
    from onnx import numpy_helper

    from fp16lens.export._int8_search import _exposed, _run_all, session

    found = find_shifts(proto.graph, units)
    if not found:
        return proto, [], 0.0
    tensors = [f[0] for f in found]
    sess = session(_exposed(proto, tensors))
    values = [_run_all(sess, f, tensors) for f in feeds]
    consts = _consts(proto.graph)
    moved = onnx.ModelProto()
    moved.CopyFrom(proto)
    g = moved.graph
    nodes = {n.name: n for n in g.node}
    shifts = []
    for t, reader, add, const in found:
        v = np.concatenate(
            [np.moveaxis(x[t], 1, 0).reshape(x[t].shape[1], -1) for x in values], axis=1
        ).astype(np.float64)
        lo, hi = v.min(axis=1), v.max(axis=1)
        c = (lo + hi) / 2
        channels = len(c)
        value = consts[const].astype(np.float64)
        shape = value.shape if value.size == channels else (channels, 1, 1)
        new = (np.broadcast_to(value.reshape(-1), (channels,)) - c).reshape(shape)
        renamed = f"{const}{CENTRED}{reader}"
        g.initializer.append(numpy_helper.from_array(new.astype(np.float32), renamed))
        node = nodes[add]
        node.input[list(node.input).index(const)] = renamed
        conv = nodes[reader]
        w = consts[conv.input[1]].astype(np.float64)
        bias = w.reshape(w.shape[0], w.shape[1], -1).sum(axis=2) @ c
        if len(conv.input) > 2 and conv.input[2]:
            bias = bias + consts[conv.input[2]].astype(np.float64)
        name = f"{reader}{CENTRED}bias"
        g.initializer.append(numpy_helper.from_array(bias.astype(np.float32), name))
        if len(conv.input) > 2:
            conv.input[2] = name
        else:
            conv.input.append(name)
        amax = float(np.maximum(np.abs(lo), np.abs(hi)).max())
        shifts.append(Shift(t, reader, add, const, tuple(float(x) for x in c), amax))
    return proven(proto, moved, shifts, feeds)
