"""INT8 calibration and fallback measured at the model's output.

One *switch graph* holds the whole search: every unit (``_int8_place.Unit``) reads
``Where(on[u], DQ(Q(x, scale[t])), x)`` for each activation ``x`` and the same form for
its weight (quantized per channel beforehand), with ``on`` and ``scale`` fed at run time:
switched on, a unit reads exactly the values the written Q/DQ graph gives it (a blend
``x + on * (DQ(Q(x)) - x)`` rounds in FP32, and a target met by a hair in the search
could be missed as written).
One ONNX Runtime session then answers every question by feeds alone:

1. **Calibration per tensor.** For each quantized tensor, each histogram candidate (max,
   percentiles, entropy; ``_int8_calib``) is tried with only that tensor's readers in INT8;
   the candidate with the least error at the outputs (normalized MSE to FP32) is kept,
   the widest among equals. A clip that breaks a threshold downstream costs at the output,
   so it loses there.
2. **Cost of each unit.** Every unit (not the first N) is switched on alone; its output
   error ranks it.
3. **Fallback.** With all units in INT8, the target (worst output cosine, or a task
   metric) is checked on the evaluation batches; if it fails, the costliest units leave
   INT8 one group at a time, then each one kept out is tried back in: the fewest that keep
   the target, named with their cost. With a task metric, "costliest" is measured by that
   metric (each unit alone in INT8 on the evaluation batches), not by the output error.
   The same growth also runs ranked per FLOP, and the set with fewer FLOPs out is kept.
   Where the chosen ranges still miss the target, the fallback runs again with every
   range at its calibration max (``Searcher.fallback``).

The result is written as plain Q/DQ (``write_qdq``); evaluated as written it computes what
the switch graph computed with those feeds.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NamedTuple

import numpy as np

from fp16lens._core import ExportError, onnx_large
from fp16lens._core.onnx_types import ancestors
from fp16lens.export._int8_calib import Histogram
from fp16lens.export._int8_metrics import NAMED, aligned, named_target
from fp16lens.export._int8_place import Unit, find_units, name_nodes, node_flops

QMAX = 127.0
MAX_FALLBACK = 0.1  # the share of the FLOPs a target's fallback may keep out of INT8
Feed = dict  # input name -> np.ndarray
Outputs = list  # the graph's outputs on one batch, np.ndarrays


PROGRESS: contextvars.ContextVar[Any] = contextvars.ContextVar("int8_progress", default=None)
"""A ``rich.progress.Progress`` the search shows its loops on (``_int8.quantize_fp16lens`` sets it:
a bar on stderr in a terminal), or None."""


@contextlib.contextmanager
def _step(what: str, total: int | None):
    """A bar for one loop of the search (``advance`` per step), where one is shown; a loop
    of unknown length (``total`` None) shows its steps on a pulsing bar."""
    progress = PROGRESS.get()
    if progress is None or total == 0:
        yield lambda: None
        return
    task = progress.add_task(f"INT8: {what}", total=total)
    try:
        yield lambda: progress.advance(task)
    finally:
        progress.remove_task(task)


@dataclass(frozen=True)
class Target:
    """Parity to hold on the evaluation batches: ``metric(refs, outs) >= threshold``, where
    ``refs``/``outs`` are per batch the FP32 and INT8 outputs (lists of arrays); without a
    metric, the worst cosine over batches and float outputs."""

    threshold: float
    metric: Callable[[list[Outputs], list[Outputs]], float] | None = None
    name: str = "worst output cosine"

    NAMES: ClassVar[tuple[str, ...]] = tuple(NAMED)  # what ``named`` takes

    def score(self, refs: list[Outputs], outs: list[Outputs]) -> float:
        if self.metric is not None:
            return float(self.metric(refs, outs))
        return worst_cosine(refs, outs)

    @classmethod
    def named(cls, name: str, threshold: float) -> Target:
        """The target a terminal names (``fp16lens export --target sqnr=30``), one of
        ``NAMES``: ``cosine`` (the worst output cosine), ``mean-cosine``, ``sqnr`` (the
        worst batch and output's SQNR in dB, ``worst_sqnr``), ``top1`` and ``ctc``
        (``top1_margin`` and ``ctc_margin`` of output 0, blank 0); ExportError (one line)
        for another name or a threshold the metric cannot reach."""
        return named_target(name, threshold)


def as_target(target) -> Target | None:
    if target is None or isinstance(target, Target):
        return target
    if isinstance(target, (int, float)) and 0 < float(target) <= 1:
        return Target(float(target))
    raise ExportError(
        f"target must be a cosine in (0, 1] or fp16lens.export.Int8Target(threshold, metric), "
        f"got {target!r}"
    )


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = (x.ravel() for x in aligned(a, b))
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    return float(a @ b / (na * nb)) if na and nb else 0.0


def worst_cosine(refs: list[Outputs], outs: list[Outputs]) -> float:
    """The worst cosine of a float output on one batch, or of one output over every batch
    about FP32's mean where it varies (verify's ``cosine_about_mean``: a score whose error
    a plain cosine cannot see beside its offset, one value per batch among them)."""
    per_batch = [
        cosine(r, o)
        for ref, out in zip(refs, outs)
        for r, o in zip(ref, out)
        if np.asarray(r).dtype.kind == "f"
    ]
    return min(per_batch + _about_means(refs, outs))


def _about_means(refs: list[Outputs], outs: list[Outputs]) -> list[float]:
    """Per float output that varies (``_core.parity.about_mean_of``), its cosine about
    FP32's mean over every batch together, as verify judges; NaN counts as -1."""
    from fp16lens._core.parity import about_mean_of

    found = []
    for j, first in enumerate(refs[0] if refs else []):
        if np.asarray(first).dtype.kind != "f":
            continue
        pairs = [aligned(ref[j], out[j]) for ref, out in zip(refs, outs)]
        r = np.concatenate([a.ravel() for a, _ in pairs])
        c = about_mean_of(r, np.concatenate([b.ravel() for _, b in pairs]))
        if c is not None:
            found.append(-1.0 if math.isnan(c) else c)
    return found


def _output_errors(refs: list[Outputs], outs: list[Outputs]) -> np.ndarray:
    """``nmse`` of each batch (rows) and float output (columns) on its own; a row's mean is
    the batch's ``nmse`` (0 where no output is float, as ``nmse``)."""
    return np.array(
        [
            [nmse([[r]], [[o]]) for r, o in zip(ref, out) if np.asarray(r).dtype.kind == "f"]
            or [0.0]
            for ref, out in zip(refs, outs)
        ]
    ).reshape(len(refs), -1)


NOISE = 1e-6  # an output's nmse under this (cosine above 0.9999995) is no loss to guard


def _raises(before: np.ndarray, after: np.ndarray, outputs: Sequence[str]) -> str | None:
    """None where ``after`` (batches x outputs, ``_output_errors``) lowers ``before`` on a
    held-out half: the batches' mean and the worst batch, of the outputs together and of
    each output on its own (above ``NOISE``); else what it raises ("" for the outputs
    together), or that the half had no error above ``NOISE`` to lower. Each output on its
    own: a correction that halves a model's side output can leave the one the task reads
    worse (easyocr CRAFT's feature map and its score maps). A half with nothing above
    ``NOISE`` shows nothing: PP-OCR's text-line classifier writes a softmax its calibration
    lines saturate, one half's error was 1.3e-13 -> 2.5e-14 with fitted codes, and the
    codes kept on the other half alone tripled the error of FP32's class probability on 96
    held-out lines (2.3e-3 -> 7.1e-3)."""
    b, a = before.mean(axis=1), after.mean(axis=1)
    if b.max() <= NOISE:
        return f"no error above {NOISE:.0e} to lower"
    if not (a.mean() < b.mean() and a.max() < b.max()):
        return ""
    if before.shape[1] < 2:
        return None
    for j, name in enumerate(outputs):
        for what, of in (("mean", np.mean), ("worst batch", np.max)):
            was, now = float(of(before[:, j])), float(of(after[:, j]))
            if now > max(was, NOISE):
                return f"raises output {name!r} {what} {was:.2e} -> {now:.2e}"
    return None


RESHAPING = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity")


RECURRENT = ("LSTM", "GRU", "RNN")


def softmax_made(graph, tensors: Sequence[str]) -> list[str]:
    """The ``tensors`` a Softmax makes, directly or through ops that only move its values
    (``RESHAPING``). A softmax's largest values are what it decides (the key a query
    attends to, the bin a YOLOv8 box edge sits on, read by the DFL conv): a clipped range
    changes exactly those, while the many small values it leaves finer can still lower
    the output error on the calibration batches. Their range stays the calibration max. Nor
    does a layer reading one get a bias correction or fitted weight codes: both are fitted
    over every position, and a softmax's error differs between the many flat positions
    (background anchors) and the few peaked ones that decide (NudeNet's YOLOv8n: box IoU of
    the matched detections 0.946 with every conv corrected, 0.968 with all but the DFL
    conv)."""
    made = {o: n for n in graph.node for o in n.output}
    found = []
    for t in tensors:
        node = made.get(t)
        while node is not None and node.op_type in RESHAPING:
            node = made.get(node.input[0])
        if node is not None and node.op_type == "Softmax":
            found.append(t)
    return found


def recurrent_fed(graph, tensors: Sequence[str]) -> list[str]:
    """The ``tensors`` a recurrent op (LSTM, GRU, RNN) reads, directly or through any ops
    before it (in a CRNN, every tensor of its convolutions). Their ranges stay the
    calibration max, and the layers reading them get neither a bias correction nor fitted
    weight codes (``unfitted``): a recurrent op carries each frame's error into its state
    and on through the frames after it, so what a clip or a fit to the calibration
    sequences costs depends on the whole sequence, and those sequences do not show it for
    others. On ddddocr's OCR (convolutions, an LSTM, 8210 characters) the clips chosen on 2
    calibration words lowered the all-INT8 error on all 8 and read 22 of 24 held-out words
    as FP32 (cosine 0.9912), against 23 (0.9956) at the max; with the ranges at the max,
    the bias correction both held-out calibration halves kept (22 layers) read 21 (0.9889).
    On easyocr's english_g2 (VGG, two BiLSTMs) the fitted codes both halves kept on 4
    weights read a cosine of 0.99875 on 96 held-out lines, against 0.99924 without them."""
    starts = [n.input[0] for n in graph.node if n.op_type in RECURRENT]
    up = ancestors(graph, starts, through_bodies=True) or set()
    seen = set(starts) | {t for i in up for t in graph.node[i].input}
    return [t for t in tensors if t in seen]


def unfitted(graph, units: Sequence[Unit], tensors: Sequence[str]) -> list[Unit]:
    """The ``units`` that read a tensor ``softmax_made`` or ``recurrent_fed`` finds: no bias
    correction, no fitted codes (each fitted over every position of the calibration
    batches, which the flat ones dominate, or which a recurrence carries on)."""
    made = set(softmax_made(graph, tensors)) | set(recurrent_fed(graph, tensors))
    return [u for u in units if made.intersection(u.acts)]


def nmse(refs: list[Outputs], outs: list[Outputs]) -> float:
    """Mean over batches and float outputs of ||out - ref||^2 / ||ref||^2."""
    costs = []
    for ref, out in zip(refs, outs):
        for r, o in zip(ref, out):
            if np.asarray(r).dtype.kind != "f":
                continue
            r, o = aligned(r, o)
            d = float(np.sum((o - r) ** 2))
            costs.append(d / max(float(np.sum(r * r)), 1e-30))
    return float(np.mean(costs)) if costs else 0.0


def session(proto):
    """ONNX Runtime on the CPU with graph optimizations off: the graph computed as written."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return onnx_large.session(ort, proto, options)


ON_GRID = 1e-5  # a weight value within this many steps of a grid is on it


def exact_levels(rows: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """Per row (channel), the fewest levels ``m`` <= 127 such that every value is a whole
    multiple of ``amax / m``, else 127: a weight on such a grid is stored exactly with the
    scale ``amax / m`` (YOLOv8's DFL conv reads its 16 bins with the weights 0, 1, ..., 15:
    ``m`` 15, the codes the weights themselves; with 127 levels they would be 0, 8.47, ...
    rounded). Every ``m`` is tried at once on each row's first few values, which rules out
    nearly every row of a trained weight, and only the ``m`` left are tried on the whole row,
    smallest first (the same arithmetic as one row at a time: the same levels)."""
    levels = np.full(len(rows), QMAX)
    safe = np.maximum(amax, 1e-30)[:, None]
    steps = np.arange(1, int(QMAX), dtype=rows.dtype)  # exact in float32, as the ints are
    for start in range(0, len(rows), _GRID_ROWS):
        head = rows[start : start + _GRID_ROWS, :_GRID_HEAD] / safe[start : start + _GRID_ROWS]
        x = head[:, None, :] * steps[None, :, None]
        near = np.abs(x - np.rint(x)).max(axis=2) <= ON_GRID  # (rows, m): a grid not ruled out
        for r in np.nonzero(near.any(axis=1))[0]:
            i = start + r
            if not amax[i] > 0:
                continue
            for m in steps[near[r]]:
                x = rows[i] / safe[i] * m
                if np.abs(x - np.rint(x)).max() <= ON_GRID:
                    levels[i] = m
                    break
    return levels


_GRID_HEAD = 8  # the values per row every grid is first tried on
_GRID_ROWS = 4096  # rows tried at once: 4096 x 126 x 8 float32 values, 16 MB


def on_grid(proto, units: Sequence[Unit], on: Sequence[bool]) -> list[str]:
    """The weights of the units switched ``on`` that ``quantize_weight`` stores exactly on
    a grid of fewer than 127 steps in some channel (``exact_levels``)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    found: list[str] = []
    for u, o in zip(units, on):
        if not o or u.weight is None or u.weight not in inits or u.axis is None:
            continue
        w = numpy_helper.to_array(inits[u.weight]).astype(np.float32)
        if (weight_levels(w, u.axis) < QMAX).any():
            found.append(u.weight)
    return found


def _channels(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``w`` as one row per channel along ``axis`` (one row when None), and each row's
    largest magnitude."""
    rows = w.reshape(1, -1) if axis is None else np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    return rows, (np.abs(rows).max(axis=1) if w.size else np.zeros(1, np.float32))


def weight_levels(w: np.ndarray, axis: int | None) -> np.ndarray:
    """Per channel of ``w``, the levels ``quantize_weight`` stores it on (``exact_levels``:
    fewer than 127 where the channel lies on such a grid)."""
    return exact_levels(*_channels(w, axis))


def quantize_weight(
    w: np.ndarray, axis: int | None, codes: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8 of ``w``, per channel along ``axis`` (per tensor when None):
    (int8 values, float32 scales); ``codes``: the values fitted for it (``_int8_round``),
    on the same scales, instead of the nearest."""
    w = np.asarray(w, np.float32)
    rows, amax = _channels(w, axis)
    scale = (np.maximum(amax, 1e-8) / exact_levels(rows, amax)).astype(np.float32)
    if axis is None:
        scale = scale.reshape(())
    shaped = (
        scale if axis is None else scale.reshape([-1 if i == axis else 1 for i in range(w.ndim)])
    )
    if codes is not None:
        return np.asarray(codes, np.int8), scale
    q = np.clip(np.rint(w / shaped), -QMAX, QMAX).astype(np.int8)
    return q, scale


# ---- collecting statistics ---------------------------------------------------------------


def _exposed(proto, names: Sequence[str]):
    import onnx

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    present = (
        {o.name for o in model.graph.output}
        | {i.name for i in model.graph.input}
        | {i.name for i in model.graph.initializer}
    )
    for name in names:
        if name not in present:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, 1, None))
            present.add(name)
    return model


def _run_all(sess, feed: Feed, names: Sequence[str]) -> dict[str, np.ndarray]:
    outs = [o.name for o in sess.get_outputs()]
    got = dict(zip(outs, sess.run(outs, feed)))
    return {n: got[n] if n in got else feed[n] for n in names if n in got or n in feed}


def collect(
    proto, units: list[Unit], feeds: list[Feed]
) -> tuple[dict[str, Histogram], list[dict[str, tuple[int, ...]]]]:
    """Per activation tensor its histogram over ``feeds``, and per feed the shapes of every
    tensor a conv-like node reads or writes (for FLOPs: batches of other sizes do other
    work, and a layer after a global pool does the same on every size)."""
    acts = list(dict.fromkeys(t for u in units for t in u.acts))
    compute = [
        n for n in proto.graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul")
    ]
    shaped = list(
        dict.fromkeys([*(t for n in compute for t in n.input[:2]), *(n.output[0] for n in compute)])
    )
    sess = session(_exposed(proto, [*acts, *shaped]))
    hists = {t: Histogram() for t in acts}
    shapes: list[dict[str, tuple[int, ...]]] = []
    for feed in feeds:
        values = _run_all(sess, feed, list(dict.fromkeys([*acts, *shaped])))
        shapes.append({n: tuple(np.shape(v)) for n, v in values.items()})
        for t in acts:
            hists[t].see_max(values[t])
    for feed in feeds:
        values = _run_all(sess, feed, acts)
        for t in acts:
            hists[t].add(values[t])
    return hists, shapes


# ---- the switch graph ----------------------------------------------------------------------

ON, SCALE = "fp16lens_int8_on", "fp16lens_int8_scale"


def switch_graph(
    proto,
    units: list[Unit],
    tensors: list[str],
    corrections: dict | None = None,
    shadow: Sequence[str] = (),
    rounded: dict | None = None,
    fp16_scales: bool = False,
):
    """A copy of ``proto`` whose units are switched by the inputs ``ON`` (one float per unit)
    and whose activations are quantized with the scales of input ``SCALE`` (one per tensor);
    a unit in ``corrections`` reads its bias with that per-channel correction added when on
    (the sum ``write_qdq`` stores); a weight in ``rounded`` takes those INT8 codes
    (``_int8_round``) instead of the nearest. ``fp16_scales``: each weight dequantized
    through its scale rounded to FP16, as the file typed FP16 stores it. Each unit node in
    ``shadow`` also gets a float twin reading its unquantized inputs, its output and the
    twin's exposed as graph outputs (``<output>`` and ``<output>__shadow``)."""
    import onnx
    from onnx import helper, numpy_helper

    from fp16lens.export._int8_typed import fp16_weight_codes

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    g.input.append(helper.make_tensor_value_info(ON, onnx.TensorProto.FLOAT, [len(units)]))
    g.input.append(helper.make_tensor_value_info(SCALE, onnx.TensorProto.FLOAT, [len(tensors)]))
    g.initializer.append(numpy_helper.from_array(np.array(0, np.int8), "fp16lens_int8_zp"))
    index = {t: j for j, t in enumerate(tensors)}
    by_node: dict[str, list[int]] = {}
    for i, u in enumerate(units):
        by_node.setdefault(u.node, []).append(i)
    made: set[str] = set()
    nodes = []

    def const(name: str, value) -> str:
        g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def switched(cond: str, out: str, on_nodes: list, off: str):
        """``out``: what ``on_nodes`` make (their last output) where ``cond``, else ``off``.
        An If, not a Where: a unit that is off computes no Q/DQ, and a weight is not
        chosen element by element (the Where form made PP-OCRv4's detector's runs 4 times
        as long), with the same values to the bit (``scripts/bench_int8_switch.py``)."""
        then = helper.make_graph(
            on_nodes,
            f"{out}__on",
            [],
            [helper.make_tensor_value_info(on_nodes[-1].output[0], 1, None)],
        )
        other = helper.make_graph(
            [helper.make_node("Identity", [off], [f"{out}__off"])],
            f"{out}__off",
            [],
            [helper.make_tensor_value_info(f"{out}__off", 1, None)],
        )
        return helper.make_node("If", [cond], [out], then_branch=then, else_branch=other)

    shadows = []
    for node in g.node:
        if node.name in shadow:
            twin = onnx.NodeProto()
            twin.CopyFrom(node)
            twin.name = f"{node.name}__shadow"
            del twin.output[:]
            twin.output.append(f"{node.output[0]}__shadow")
            shadows.append(twin)
            g.output.extend(
                [
                    helper.make_tensor_value_info(node.output[0], 1, None),
                    helper.make_tensor_value_info(twin.output[0], 1, None),
                ]
            )
        for i in by_node.get(node.name, []):
            u = units[i]
            on = f"fp16lens_on_{i}"
            nodes += [
                helper.make_node("Gather", [ON, const(f"{on}_idx", np.array(i, np.int64))], [on]),
                helper.make_node("Cast", [on], [f"{on}_b"], to=onnx.TensorProto.BOOL),
            ]
            for t in u.acts:
                s, read = f"{t}__s", f"{t}__u{i}"
                if t not in made:
                    made.add(t)
                    j = const(f"{s}_idx", np.array(index[t], np.int64))
                    nodes.append(helper.make_node("Gather", [SCALE, j], [s]))
                quantized = [
                    helper.make_node("QuantizeLinear", [t, s, "fp16lens_int8_zp"], [f"{read}__q"]),
                    helper.make_node(
                        "DequantizeLinear", [f"{read}__q", s, "fp16lens_int8_zp"], [f"{read}__dq"]
                    ),
                ]
                nodes.append(switched(f"{on}_b", read, quantized, t))
                for k, name in enumerate(node.input):
                    if name == t:
                        node.input[k] = read
            if u.weight is not None:
                wt = numpy_helper.to_array(inits[u.weight]).astype(np.float32)
                wq, scale = quantize_weight(wt, u.axis, (rounded or {}).get(u.weight))
                if fp16_scales:  # the typed file's codes and scale (``fit_weight_scales``)
                    wq, scale = fp16_weight_codes(wq, scale, u.axis)
                shaped = (
                    scale
                    if u.axis is None
                    else scale.reshape([-1 if a == u.axis else 1 for a in range(wt.ndim)])
                )
                if fp16_scales:  # the typed file's scale
                    shaped = shaped.astype(np.float16)
                dequantized = const(  # as DequantizeLinear computes it: q * scale in FP32
                    f"{u.weight}__dq{i}", wq.astype(np.float32) * shaped.astype(np.float32)
                )
                read = f"{u.weight}__u{i}"
                on_branch = [helper.make_node("Identity", [dequantized], [f"{read}__dq"])]
                nodes.append(switched(f"{on}_b", read, on_branch, u.weight))
                node.input[1] = read
            if corrections and u.node in corrections:
                # the corrected bias as ``write_qdq`` stores it, one sum in FP32 (a sum in
                # the graph would round twice with the float parts in FP16)
                corr = corrections[u.node].astype(np.float32)
                bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
                if bias:
                    off, summed = bias, numpy_helper.to_array(inits[bias]).astype(np.float32) + corr
                else:
                    off, summed = const(f"{u.node}__nobias", np.zeros_like(corr)), corr
                read = f"{u.node}__bias"  # a Where: one bias vector, not a whole weight
                corrected = const(f"{u.node}__corrected", summed)
                nodes.append(helper.make_node("Where", [f"{on}_b", corrected, off], [read]))
                if bias:
                    node.input[2] = read
                else:
                    node.input.append(read)
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes + shadows)  # a twin reads only what its node reads: last is fine
    return model


class Switch:
    """The switch graph in one session, run on a fixed list of batches. ``fp16_parts``:
    computed as the file typed with its float parts FP16 computes it (``_fp16_parts``)."""

    def __init__(
        self,
        proto,
        units: list[Unit],
        tensors: list[str],
        corrections: dict | None = None,
        rounded: dict | None = None,
        fp16_parts: bool = False,
    ):
        self.units, self.tensors, self.fp16_parts = units, tensors, fp16_parts
        graph = switch_graph(
            proto, units, tensors, corrections, rounded=rounded, fp16_scales=fp16_parts
        )
        self.raw: dict[str, str] = {}  # input -> the name its FP32 readers read it by
        if fp16_parts:
            graph, self.raw = _fp16_parts(graph)
        self.sess = session(graph)
        self.outputs = [o.name for o in proto.graph.output]
        self.runs = 0

    def run(self, feeds: list[Feed], on: np.ndarray, scales: np.ndarray) -> list[Outputs]:
        extra = {ON: on.astype(np.float32), SCALE: scales.astype(np.float32)}
        if self.fp16_parts:  # the file's FP16 scales and inputs (as given to FP32 nodes)
            extra[SCALE] = fp16_activation_scales(extra[SCALE])
            feeds = [
                {**{k: _half(a) for k, a in f.items()}, **{r: f[k] for k, r in self.raw.items()}}
                for f in feeds
            ]
        self.runs += len(feeds)
        return [self.sess.run(self.outputs, {**f, **extra}) for f in feeds]


def fp16_activation_scales(scales: np.ndarray) -> np.ndarray:
    """Activation scales as the typed file stores them (``_int8_typed.act_scale_floored``,
    then FP16), in FP32."""
    from fp16lens.export._int8_typed import act_scale_floored

    return act_scale_floored(scales).astype(np.float16).astype(np.float32)


def _half(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32) if a.dtype == np.float32 else a


def _fp16_parts(graph) -> tuple[Any, dict[str, str]]:
    """The switch graph with what the typed file (``float_parts="fp16"``,
    ``_int8_typed.typed_fp16``) stores in FP16 rounded so: every float tensor a node writes
    (a unit's dequantized input and weight among them) and every float initializer, but
    the FP32 nodes the file names and the nodes reading an initializer beyond FP16, which
    the typed file keeps FP32 (``patch/onnx/_fp16.fp16_storage``). Its inputs and scales
    are rounded as they are fed (``Switch.run``), its weights dequantized through FP16
    scales (``switch_graph(fp16_scales=True)``): the typed file's outputs to the bit. One
    rounding apart flips INT8 codes downstream, and PP-OCRv6's tiny detector read IoU 0.9818
    here where its typed file read 0.9790. A kept node reading a graph input reads it as
    given, as in the typed file (its inputs stay FP32, ``io_dtype="fp32"``): through a
    second input, fed unrounded (the map returned: input -> that name)."""
    import json

    from fp16lens._core.onnx_types import FP32_NODES_KEY
    from fp16lens.export._int8_typed import fit_weight_scales, wide_initializers
    from fp16lens.patch.onnx import fp32_nodes
    from fp16lens.patch.onnx._fp16 import fp16_storage

    g = graph.graph
    fit_weight_scales(graph)  # a weight the graph dequantizes (a grid-encoded input's conv)
    wide = wide_initializers(graph)
    kept = set(fp32_nodes(graph))
    for node in g.node:
        if not wide & set(node.input):
            continue
        if node.name:
            kept.add(node.name)
        else:  # a switch node (a corrected bias's Where): fp16_storage knows it by its
            # output, and its readers stay FP32, as the file's conv reading that bias does
            # (with the unit on; off, the file's bias may be an FP16 value)
            kept.add(node.output[0])
            kept |= {r.name for r in g.node if node.output[0] in r.input and r.name}
    keep = sorted(kept)
    floats = {  # the graph's own float inputs (the switch's ON and SCALE are not fed so)
        v.name: v
        for v in g.input
        if v.type.tensor_type.elem_type == 1 and v.name not in (ON, SCALE)
    }
    raw: dict[str, str] = {}
    for node in g.node:
        if (node.name or node.output[0]) in keep:  # as fp16_storage names a node
            for k, name in enumerate(node.input):
                if name in floats:
                    raw[name] = node.input[k] = f"{name}__fp32"
    for name, alias in raw.items():
        given = g.input.add()
        given.CopyFrom(floats[name])
        given.name = alias
    _rounded_for_fp16_readers(graph, set(keep))
    for p in list(graph.metadata_props):
        if p.key == FP32_NODES_KEY:
            graph.metadata_props.remove(p)
    graph.metadata_props.add(key=FP32_NODES_KEY, value=json.dumps(keep))
    return fp16_storage(graph, initializers=True)[0], raw


def _rounded_for_fp16_readers(graph, keep: set[str]) -> None:
    """Each float tensor a ``keep`` node writes rounded to FP16 for every other reader (a
    unit's Q inside its If among them), as the typed file's Cast before them rounds it; the
    ``keep`` nodes and the graph's outputs read it as written."""
    import onnx
    from onnx import TensorProto, helper

    from fp16lens._core.onnx_types import elem_types, rename_reads, subgraphs

    g = graph.graph
    types = elem_types(graph, onnx)
    outputs = {o.name for o in g.output}
    written: dict[str, str] = {}  # tensor -> the name its keep node now writes it by
    nodes = []
    for node in g.node:
        nodes.append(node)
        if not node.name or node.name not in keep:  # (fp16_storage knows an unnamed node
            continue  # by its output, which stays)
        node.input[:] = [written.get(t, t) for t in node.input]
        for body in subgraphs(node):  # a kept If's branches read it as written too
            rename_reads(body, written)
        for k, out in enumerate(node.output):
            if not out or out in outputs or types.get(out) != TensorProto.FLOAT:
                continue
            written[out] = node.output[k] = f"{out}__fp32"
            nodes += [
                helper.make_node("Cast", [written[out]], [f"{out}__h"], to=TensorProto.FLOAT16),
                helper.make_node("Cast", [f"{out}__h"], [out], to=TensorProto.FLOAT),
            ]
    del g.node[:]
    g.node.extend(nodes)


def _channel_means(values: list[np.ndarray], axis: int) -> np.ndarray:
    moved = [
        np.moveaxis(np.asarray(v, np.float64), axis, 0).reshape(np.shape(v)[axis], -1)
        for v in values
    ]
    return np.concatenate(moved, axis=1).mean(axis=1)


def bias_corrections(
    proto,
    units: list[Unit],
    tensors: list[str],
    scales: np.ndarray,
    feeds: list[Feed],
    rounded: dict | None = None,
) -> dict[str, np.ndarray]:
    """Per output channel, minus the mean error each Conv/ConvTranspose/Gemm (with a bias)
    adds by itself in the all-INT8 graph on ``feeds``: its output against a float twin
    reading the same, unquantized, inputs. One pass, no compounding: the error a layer
    passes on is corrected where it arises."""
    nodes = {n.name: n for n in proto.graph.node}
    peaked = {u.node for u in unfitted(proto.graph, units, tensors)}
    where = {
        u.node: (1 if u.op != "Gemm" else -1)
        for u in units
        if (
            u.op in ("Conv", "ConvTranspose")
            or (u.op == "Gemm" and len(nodes[u.node].input) > 2 and nodes[u.node].input[2])
        )
        and u.node not in peaked
    }
    if not where:
        return {}
    sess = session(switch_graph(proto, units, tensors, None, list(where), rounded))
    names = [f"{nodes[n].output[0]}{suffix}" for n in where for suffix in ("", "__shadow")]
    extra = {ON: np.ones(len(units), np.float32), SCALE: scales.astype(np.float32)}
    got = [sess.run(names, {**f, **extra}) for f in feeds]
    corrections = {}
    for k, (node, axis) in enumerate(where.items()):
        diff = [g[2 * k] - g[2 * k + 1] for g in got]
        corrections[node] = -_channel_means(diff, axis)
    return corrections


# ---- the search ----------------------------------------------------------------------------


@dataclass
class Kept:
    """A unit left out of INT8, with what it cost alone (normalized MSE at the output, and
    with a task metric, the metric's loss on the evaluation batches)."""

    node: str
    op: str
    cost: float
    flops: int
    task_loss: float | None = None
    alone: float | None = None  # the task metric with this unit alone in INT8
    metric: str = ""  # that metric's name

    def __str__(self) -> str:
        task = f", {self.metric} {self.alone:.4f}" if self.alone is not None else ""
        return f"{self.node} ({self.op}, error {self.cost:.2e}{task} alone)"


@dataclass
class Int8Plan:
    """What the INT8 search decided and measured."""

    units: list[Unit]
    scales: dict[str, float]  # activation tensor -> scale (amax / 127)
    methods: dict[str, str]  # activation tensor -> calibration method kept
    on: list[bool]
    kept: list[Kept] = field(default_factory=list)
    score: float | None = None  # the target's metric on the evaluation batches
    target: Target | None = None
    costs: list[float] = field(default_factory=list)
    runs: int = 0
    corrections: dict = field(default_factory=dict)  # unit node -> per-channel bias correction
    notes: list[str] = field(default_factory=list)
    graph: object = None  # the FP32 graph the units read, when equalization rewrote it
    equalized: list[str] = field(default_factory=list)  # readers whose input scale moved
    centred: list[str] = field(default_factory=list)  # readers whose input was centred
    cache_amax: dict = field(default_factory=dict)  # centred tensor -> its uncentred max |x|
    encoded: list[str] = field(default_factory=list)  # readers of an input on an 8-bit grid
    rounded: dict = field(default_factory=dict)  # weight -> its fitted INT8 codes

    @property
    def int8_flop_share(self) -> float:
        total = sum(u.flops for u in self.units)
        return sum(u.flops for u, o in zip(self.units, self.on) if o) / total if total else 0.0

    def method_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for m in self.methods.values():
            counts[m] = counts.get(m, 0) + 1
        return counts

    def to_dict(self) -> dict:
        """Plain data (JSON): what the plan quantized, what it kept out of INT8 and why."""
        total = sum(u.flops for u in self.units) or 1
        target = self.target
        return {
            "units": len(self.units),
            "quantized": int(sum(self.on)),
            "int8_flop_share": self.int8_flop_share,
            "scales": self.method_counts(),
            "target": None
            if target is None
            else {"metric": target.name, "threshold": target.threshold, "score": self.score},
            "kept": [
                {
                    "node": k.node,
                    "op": k.op,
                    "flop_share": k.flops / total,
                    "error_alone": k.cost,  # normalized MSE at the output, alone in INT8
                    "metric_alone": k.alone,  # the target's metric, alone in INT8
                }
                for k in self.kept
            ],
            "equalized": list(self.equalized),
            "centred": list(self.centred),
            "encoded": list(self.encoded),
            "bias_corrected": sorted(self.corrections),
            "rounded": sorted(self.rounded),
        }

    def summary(self) -> str:
        methods = ", ".join(f"{m} {n}" for m, n in sorted(self.method_counts().items()))
        line = (
            f"INT8: {sum(self.on)}/{len(self.units)} units quantized "
            f"({self.int8_flop_share:.1%} of conv/gemm/matmul FLOPs), "
            f"{len(self.scales)} activation scales ({methods})"
        )
        if self.notes:
            line += "; " + "; ".join(self.notes)
        if self.target is not None and self.score is not None:
            line += f"; {self.target.name} {self.score:.4f} (target {self.target.threshold:.12g})"
        if self.kept:
            line += "; kept out of INT8: " + ", ".join(map(str, self.kept))
        return line


def _int8_errors(graphs, feeds: list[Feed], pinned: dict, only=None) -> list[float]:
    """The output error with every unit in INT8 (or the units of the nodes in ``only``),
    max ranges (the ``pinned`` tensors at their own scale), of each (graph, units) on
    ``feeds``."""
    errors = []
    for graph, us in graphs:
        hists, _ = collect(graph, us, feeds)
        tensors = list(hists)
        scales = np.array([pinned.get(t, max(hists[t].amax, 1e-8) / QMAX) for t in tensors])
        switch = Switch(graph, us, tensors)
        on = np.array([only is None or u.node in only for u in us], np.float64)
        refs = switch.run(feeds, np.zeros(len(us)), scales)
        errors.append(nmse(refs, switch.run(feeds, on, scales)))
    return errors


def _encoded(proto, units: list[Unit], feeds: list[Feed], exclude, residual: bool):
    """(graph, its units, grids, note): the exact encoding of inputs on an 8-bit grid
    (``_int8_grid``), kept when it is exact in FP32 and lowers the output error of its
    readers alone in INT8 (max ranges) on the calibration batches; else ``proto`` unchanged
    (no note where no input holds a grid). Judged on the readers alone: with every unit in
    INT8 the other units' errors dominate and, on two batches, cancel by chance (MTCNN
    RNet: all in INT8 on two batches 1.9e-4 -> 9.0e-4, on all eight 1.8e-3 -> 8.3e-4; its
    first conv alone 1.9e-4 -> 1.0e-4)."""
    from fp16lens.export import _int8_grid as grid

    moved, grids, change = grid.encode(proto, units, feeds)
    if not grids:
        return (
            proto,
            units,
            [],
            f"grid encoding left out (not exact: {change:.1e})" if change else "",
        )
    moved_units = find_units(moved.graph, set(exclude), residual)
    errors = _int8_errors(
        ((proto, units), (moved, moved_units)),
        feeds,
        {g.tensor: 1.0 for g in grids},
        {g.reader for g in grids},
    )
    kept = errors[1] < errors[0]
    inputs = f"{len(grids)} input{'s' if len(grids) != 1 else ''}"
    note = (
        f"grid encoding {'kept' if kept else 'left out'} ({inputs} on an 8-bit grid, INT8 "
        f"scale 1; output error with its readers in INT8 {errors[0]:.2e} -> {errors[1]:.2e}; "
        f"FP32 change {change:.1e})"
    )
    return (moved, moved_units, grids, note) if kept else (proto, units, [], note)


def _equalized(proto, units: list[Unit], feeds: list[Feed], probe: int, skip=frozenset()):
    """(graph, its units, pairs moved, note): the scale migration of ``_int8_equalize``, kept when it
    is exact in FP32 and lowers the all-INT8 output error (max ranges) on the probe
    batches; else ``proto`` unchanged."""
    from fp16lens.export import _int8_equalize as eq

    moved, pairs, change = eq.equalize(proto, units, feeds, skip)
    nodes = {n.name: n for n in moved.graph.node}
    moved_units = [
        Unit(u.node, u.op, u.acts, nodes[u.node].input[1], u.axis) if u.weight else u for u in units
    ]  # the movers read new weights
    if not pairs:
        why = f"not exact ({change:.1e})" if change else "no affine op before a quantized input"
        return proto, units, [], f"equalization left out ({why})"
    errors = _int8_errors(((proto, units), (moved, moved_units)), feeds[: max(1, probe)], {})
    kept = errors[1] < errors[0]
    note = (
        f"equalization {'kept' if kept else 'left out'} ({len(pairs)} inputs; all-INT8 output "
        f"error {errors[0]:.2e} -> {errors[1]:.2e}; FP32 change {change:.1e})"
    )
    return (moved, moved_units, pairs, note) if kept else (proto, units, [], note)


def _corrected(
    proto, units: list[Unit], tensors, feeds: list[Feed], scales, switch, *, bias, rounding
):
    """(weight -> fitted INT8 codes, unit node -> bias correction, notes): of bias
    correction (``bias_corrections``), weight rounding (``_int8_round``) and both (the biases
    measured on the rounded weights), each fitted on one half of the calibration batches and
    checked on the other, both ways, with every unit in INT8 (``scales``); among those that
    lower both the mean output error and the worst batch's on both held-out halves, of the
    outputs together and of each on its own (``_raises``), the one with the least
    worst-batch error over the two, fitted again on all the batches.

    Side by side on the same folds: checked after the rounding, on codes fitted on all the
    batches (the check half among them), bias correction looked worthless on MTCNN PNet
    (held-out 5.54e-3 -> 5.46e-3, 3.95e-3 -> 4.12e-3), where on codes fitted on the other
    half both together beat the rounding alone (5.42e-3 and 4.05e-3 against 5.59e-3 and
    4.07e-3). The worst batch, not the mean: a correction per channel is a mean over the
    batches it was fitted on and can leave a batch unlike them worse. On PP-OCRv4's
    detector both corrections lower the held-out mean more than the rounding alone (1.37e-2
    and 8.8e-3 against 1.74e-2 and 1.15e-2) and raise a scanned page crop's error (1.67e-2
    -> 2.51e-2); on the evaluation images they raised every page crop's (one 1.9e-2 ->
    1.9e-1). Never with a single calibration batch."""
    from fp16lens.export import _int8_round

    tried = [name for name, on in (("bias correction", bias), ("weight rounding", rounding)) if on]
    if not tried:
        return {}, {}, []
    if len(feeds) < 2:
        return (
            {},
            {},
            [
                f"{name} not tried: it needs two calibration batches or more (one to fit it, "
                "one to check it)"
                for name in tried
            ],
        )
    half = len(feeds) // 2
    on, off = np.ones(len(units)), np.zeros(len(units))

    skipped = {u.weight for u in unfitted(proto.graph, units, tensors)}
    # the codes fitted on each half and on every batch, from one pass over the batches
    fits = (
        _int8_round.folds(proto, units, feeds, dict(zip(tensors, scales)))
        if rounding
        else ({}, {}, {})
    )
    first, second, whole = ({w: c for w, c in f.items() if w not in skipped} for f in fits)

    errors: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # per fold: before, after
    notes = []
    outputs: list[str] = []
    for part, check, codes in (
        (feeds[:half], feeds[half:], first),
        (feeds[half:], feeds[:half], second),
    ):
        ref = switch.run(check, off, scales)
        outputs = [n for n, r in zip(switch.outputs, ref[0]) if np.asarray(r).dtype.kind == "f"]
        before = _output_errors(ref, switch.run(check, on, scales))
        candidates: dict[str, tuple[dict, dict]] = {}
        if bias:
            candidates["bias correction"] = (
                bias_corrections(proto, units, tensors, scales, part),
                {},
            )
        if codes:
            candidates["weight rounding"] = ({}, codes)
            if bias:
                candidates["both"] = (
                    bias_corrections(proto, units, tensors, scales, part, codes),
                    codes,
                )
        for name, (corr, rounded) in candidates.items():
            trial = Switch(proto, units, tensors, corr, rounded).run(check, on, scales)
            errors.setdefault(name, []).append((before, _output_errors(ref, trial)))
    if rounding and len(errors.get("weight rounding", ())) < 2:
        for name in ("weight rounding", "both"):
            errors.pop(name, None)
        notes.append(
            "weight rounding left out (on one half of the batches or both, no layer's fitted "
            "codes beat the nearest on the other half of its batches)"
        )
    # lower on both held-out halves, on the mean and on the worst batch, every output; of
    # those, the least worst batch (a mean per channel can leave a batch unlike the rest
    # worse: see above)
    raised = {n: [_raises(b, a, outputs) for b, a in e] for n, e in errors.items()}
    gaining = [n for n, r in raised.items() if len(r) == 2 and all(x is None for x in r)]
    best = min(gaining, key=lambda n: sum(a.mean(axis=1).max() for _, a in errors[n]), default=None)
    codes = whole if best in ("weight rounding", "both") else {}
    corrections = (
        bias_corrections(proto, units, tensors, scales, feeds, codes)
        if best in ("bias correction", "both")
        else {}
    )
    label = {"both": "weight rounding and bias correction"}
    counts = [f"{len(codes)} weights; "] * bool(codes) + [f"{len(corrections)} layers; "] * bool(
        corrections
    )
    for name, errs in errors.items():
        kept = name == best
        notes.append(
            f"{label.get(name, name)} {'kept' if kept else 'left out'} ("
            + "".join(counts if kept else [])
            + "output error on held-out halves "
            + ", ".join(
                f"{b.mean():.2e} -> {a.mean():.2e} (worst batch {b.mean(axis=1).max():.2e} -> "
                f"{a.mean(axis=1).max():.2e})"
                for b, a in errs
            )
            + "".join(f"; {r} on a held-out half" for r in raised[name] if r)
            + ")"
        )
    return codes, corrections, notes


class Searcher:
    """Calibration, per-tensor ranges and per-unit costs of one graph (the expensive part,
    done once); ``fallback`` then keeps units out of INT8 for a target."""

    def __init__(
        self,
        proto,
        feeds: list[Feed],
        exclude: AbstractSet[str] = frozenset(),
        *,
        search_batches: int = 2,
        residual: bool = True,
        choose: bool = True,
        correct_bias: bool = True,
        equalize: bool = True,
        encode: bool = True,
        round_weights: bool = True,
    ):
        options: dict[str, Any] = dict(
            search_batches=search_batches,
            residual=residual,
            choose=choose,
            correct_bias=correct_bias,
            equalize=equalize,
            encode=encode,
            round_weights=round_weights,
        )
        self._search(proto, feeds, exclude, options, None)

    @classmethod
    def _recalibrated(cls, source: tuple, calibrated: _Calibrated, **changed) -> Searcher:
        """The search of ``source`` (``_source``) with ``changed`` options on a calibration
        already made (``_max_twin``: the ranges do not change it)."""
        proto, feeds, exclude, options = source
        self = cls.__new__(cls)
        self._search(proto, feeds, exclude, {**options, **changed}, calibrated)
        return self

    def _search(self, proto, feeds, exclude, options: dict, calibrated: _Calibrated | None):
        name_nodes(proto.graph)
        residual = options["residual"]
        units = find_units(proto.graph, set(exclude), residual)
        if not units:
            raise ExportError(
                "INT8: the graph has no Conv/ConvTranspose/Gemm/MatMul outside the "
                "FP32 islands to quantize; export it as fp16 instead"
            )
        # what ``fallback`` needs to build the max-ranges twin
        self._source = (proto, feeds, exclude, options)
        self._twin: Searcher | None = None
        self._half: Switch | None = None  # ``half_switch``, made where a fallback needs it
        self._memo: dict = {}  # a task metric's per-unit losses, kept across targets
        self.found = units  # the units as found, before equalization and FLOPs
        search_batches, choose = options["search_batches"], options["choose"]
        if calibrated is None:
            calibrated = _calibrate(
                proto,
                units,
                feeds,
                exclude,
                residual,
                search_batches,
                options["encode"],
                options["equalize"],
            )
        # what the ranges do not change, kept for the max-ranges twin (``_max_twin``)
        self._calibrated = calibrated
        proto, units, graph, equalized, grids, _, hists, cands = calibrated
        notes = list(calibrated.notes)
        tensors = list(hists)
        scales = np.array([max(c.values()) / QMAX for c in cands.values()], np.float64)
        methods = {t: max(c, key=c.__getitem__) for t, c in cands.items()}
        self.feeds, self.switch = feeds, Switch(proto, units, tensors)
        off = np.zeros(len(units))
        probe = feeds[: max(1, search_batches)]
        refs = self.switch.run(probe, off, scales)
        readers = {t: [i for i, u in enumerate(units) if t in u.acts] for t in tensors}
        with _step("choosing each activation's range", len(tensors) if choose else 0) as tick:
            for j, t in enumerate(tensors if choose else ()):
                tick()
                if len(cands[t]) < 2:
                    continue
                on = off.copy()
                on[readers[t]] = 1
                scored = []
                for name, amax in cands[t].items():
                    trial = scales.copy()
                    trial[j] = amax / QMAX
                    out = self.switch.run(probe, on, trial)
                    scored.append((nmse(refs, out), -amax, name, amax))
                best = min(s[0] for s in scored)
                # the widest range within 2% of the least error: no clip bought for nothing
                _, _, name, amax = min(
                    (s for s in scored if s[0] <= best * 1.02 + 1e-12), key=lambda s: s[1]
                )
                scales[j], methods[t] = amax / QMAX, name
        rounded, corrections, more = _corrected(
            proto,
            units,
            tensors,
            feeds,
            scales,
            self.switch,
            bias=options["correct_bias"],
            rounding=options["round_weights"],
        )
        notes += more
        if rounded or corrections:
            self.switch = Switch(proto, units, tensors, corrections, rounded)
        self._switched = (proto, units, tensors, corrections, rounded)
        costs = []
        with _step("measuring each layer alone", len(units)) as tick:
            for i in range(len(units)):  # every unit, alone
                tick()
                on = off.copy()
                on[i] = 1
                costs.append(nmse(refs, self.switch.run(probe, on, scales)))
        self.scales = scales
        self.plan = Int8Plan(
            units,
            {t: float(s) for t, s in zip(tensors, scales)},
            methods,
            [True] * len(units),
            costs=costs,
            runs=self.switch.runs,
            corrections=corrections,
            notes=notes,
            graph=graph,
            equalized=[reader for p in equalized for reader, _, _ in p.weights()],
            encoded=[g.reader for g in grids],
            cache_amax={g.source: g.amax for g in grids},
            rounded=rounded,
        )

    def half_switch(self) -> Switch:
        """This search's switch graph with its float parts in FP16 (made once)."""
        if self._half is None:
            self._half = Switch(*self._switched, fp16_parts=True)
        return self._half

    def all_int8_error(self) -> float:
        """The output error (normalized MSE) with every unit in INT8, over every
        calibration batch."""
        n = len(self.plan.units)
        refs = self.switch.run(self.feeds, np.zeros(n), self.scales)
        return nmse(refs, self.switch.run(self.feeds, np.ones(n), self.scales))

    def fallback(
        self,
        target,
        evaluation: list[Feed] | None = None,
        max_fallback: float = MAX_FALLBACK,
        *,
        max_ranges: bool = True,
        fp16_parts: bool = False,
    ) -> Int8Plan:
        """A copy of the plan with the fewest units out of INT8 that meet ``target`` on
        ``evaluation`` (default: the calibration batches); ExportError when that needs more
        than ``max_fallback`` of the FLOPs out of INT8.

        With ``max_ranges`` (and ranges chosen), where the chosen ranges miss the target
        within ``max_fallback``, the fallback runs again with every range at its
        calibration max, and that one is kept when it meets the target: the ranges are
        chosen by the whole output's error, which is not always the target's (MTCNN ONet's
        box and landmark offsets). Only as a second chance: offered as an equal, the max
        ranges met the detector's IoU 0.98 on its 8 calibration images with 4% of the
        FLOPs out, a fit to those images (0.955 on the held-out ones, against 0.973 with
        the chosen ranges and 10% out; docs/int8.md). Where the chosen ranges meet the
        target with units out, the max ranges are scored with exactly those units out and
        kept where they score higher (the same placement, no set fitted anew).

        ``fp16_parts``: the file's float parts will be typed FP16 (``float_parts="fp16"``),
        so the target must hold both as written and with them in FP16 (``half_switch``):
        each set is scored by the lesser of the two, and what stays out of INT8 is
        measured in FP16, as the typed file computes it."""
        goal = as_target(target)
        assert goal is not None
        tried = [self]
        self._fp16_parts = fp16_parts
        result = self._fallback(goal, evaluation, max_fallback)
        chosen = self._source[3]["choose"]
        if max_ranges and chosen and not self.plan.centred and (result.share < 1 or not result.met):
            tried.append(self._max_twin())
            tried[1]._fp16_parts = fp16_parts
            if result.met:
                result = self._max_at_placement(result, goal, evaluation)
            else:
                twin = tried[1]._fallback(goal, evaluation, max_fallback)
                note = (
                    f"{'max' if twin.met else 'chosen'} ranges kept: the chosen ranges reach "
                    f"{goal.name} {result.plan.score:.4f} at {result.share:.1%} INT8, the max "
                    f"ranges {twin.plan.score:.4f} at {twin.share:.1%}"
                )
                result = twin if twin.met else result
                result.plan.notes.append(note)
        plan = result.plan
        plan.runs = sum(s.switch.runs for s in tried)
        _check(plan, max_fallback)
        return plan

    def _fallback(self, goal: Target, evaluation: list[Feed] | None, max_fallback: float):
        """The fallback on this search's ranges, unchecked."""
        import copy

        plan = copy.copy(self.plan)
        plan.notes, plan.target = list(plan.notes), goal
        feeds = evaluation or self.feeds
        half = self.half_switch() if getattr(self, "_fp16_parts", False) else None
        both = _fallback(plan, self.switch, feeds, self.scales, max_fallback, self._memo, half)
        if both:
            plan.notes.append(
                f"the fallback scored {goal.name} with the float parts in FP32 and in FP16 "
                "(float_parts='fp16'), the lesser of the two"
            )
        score = float(plan.score)  # type: ignore[arg-type]
        met = score >= goal.threshold and 1.0 - plan.int8_flop_share <= max_fallback
        return _Result(met, plan.int8_flop_share, plan)

    def _max_at_placement(self, result: _Result, goal: Target, evaluation) -> _Result:
        """``result`` (the target met, some units out) with every range at its calibration
        max instead, where the max ranges score higher at the same units out: the set found
        on the chosen ranges, not a set fitted anew (that fitted the detector's calibration
        images, see ``fallback``)."""
        import copy

        twin = self._max_twin()
        # the same graph and units: the twin differs only in its ranges (and corrections)
        assert [u.node for u in twin.plan.units] == [u.node for u in self.plan.units]
        feeds = evaluation or self.feeds
        n = len(twin.plan.units)
        on = np.array(result.plan.on, np.float64)
        refs = twin.switch.run(feeds, np.zeros(n), twin.scales)
        at = float(goal.score(refs, twin.switch.run(feeds, on, twin.scales)))
        if getattr(self, "_fp16_parts", False):  # in FP16 too, as the fallback scored it
            half = twin.half_switch().run(feeds, on, twin.scales)
            at = lesser(at, float(goal.score(refs, half)))
        chosen = float(result.plan.score)  # type: ignore[arg-type]
        if at <= chosen:
            return result
        plan = copy.copy(twin.plan)
        plan.on, plan.kept, plan.score, plan.target = (
            list(result.plan.on),
            result.plan.kept,
            at,
            goal,
        )
        plan.notes = [
            *twin.plan.notes,
            f"max ranges kept at the units out the chosen ranges needed: {goal.name} "
            f"{at:.4f} against {chosen:.4f}",
        ]
        return _Result(True, result.share, plan)

    def _max_twin(self) -> Searcher:
        """The same search with every range at its calibration max (made once)."""
        if self._twin is None:
            self._twin = Searcher._recalibrated(self._source, self._calibrated, choose=False)
        return self._twin


class _Calibrated(NamedTuple):
    """What ``_calibrate`` makes: the same for a search and its max-ranges twin."""

    proto: Any  # the graph the search runs on (encoded and equalized where kept)
    units: list  # its units, with their FLOPs
    graph: Any  # that graph where it was rewritten, else None (``Int8Plan.graph``)
    equalized: list  # the scale-migration pairs moved
    grids: list  # the inputs encoded on the INT8 codes
    notes: tuple  # what the encoding and the migration say
    hists: dict  # tensor -> its histogram
    cands: dict  # tensor -> method -> candidate range


def _calibrate(
    proto, units, feeds, exclude, residual, search_batches, encode, equalize
) -> _Calibrated:
    """What a search does before it chooses any range: the input encoding (item 7 of
    docs/int8.md) and the scale migration, each where it is kept, then every quantized
    tensor's histogram and candidate ranges, and each unit's FLOPs: the same for a search
    and its max-ranges twin, so the twin takes it as it is."""
    notes = []
    graph, equalized, grids = None, [], []
    if encode:
        proto, units, grids, note = _encoded(proto, units, feeds, exclude, residual)
        graph = proto if grids else None
        notes += [note] if note else []
    if equalize:
        proto, units, equalized, note = _equalized(
            proto, units, feeds, search_batches, {g.tensor for g in grids}
        )
        graph = proto if equalized or grids else None
        notes.append(note)
    hists, shapes = collect(proto, units, feeds)
    inits = {i.name: tuple(i.dims) for i in proto.graph.initializer}
    nodes = {n.name: n for n in proto.graph.node}
    units = [
        u
        if u.op == "Add"
        else replace(u, flops=sum(node_flops(nodes[u.node], s, inits) for s in shapes))
        for u in units
    ]
    tensors = list(hists)
    cands = {t: hists[t].candidates() for t in tensors}
    for t in softmax_made(proto.graph, tensors):  # its peaks are its decisions: no clip
        cands[t] = {"max": max(hists[t].amax, 1e-8)}
    for t in recurrent_fed(proto.graph, tensors):  # its cost depends on the sequence
        cands[t] = {"max": max(hists[t].amax, 1e-8)}
    for g in grids:  # on the INT8 codes themselves: scale 1, nothing to choose
        cands[g.tensor] = {"grid": QMAX}
    return _Calibrated(proto, units, graph, equalized, grids, tuple(notes), hists, cands)


def searcher(
    proto, feeds: list[Feed], exclude: AbstractSet[str] = frozenset(), *, centre=True, **options
) -> Searcher:
    """The ``Searcher`` of the graph as it is or, with ``centre`` where centring
    (``_int8_equalize.centre``) shifts any input, of the centred graph: the whole search made
    on both and the one whose all-INT8 output error over every calibration batch is lower
    kept (a shift can leave a constant rounding error that only bias correction takes off,
    so it is judged after the rest)."""
    from fp16lens.export import _int8_equalize as eq

    plain = Searcher(proto, feeds, exclude, **options)
    if not centre:
        return plain
    centred, shifts, change = eq.centre(proto, plain.found, feeds)
    if not shifts:
        return plain
    moved = Searcher(centred, feeds, exclude, **options)
    errors = [s.all_int8_error() for s in (plain, moved)]
    keep = errors[1] < errors[0]
    best = moved if keep else plain
    best.plan.runs = plain.switch.runs + moved.switch.runs
    if keep:
        best.plan.graph = best.plan.graph if best.plan.graph is not None else centred
        best.plan.centred = [s.reader for s in shifts]
        best.plan.cache_amax.update({s.tensor: s.amax for s in shifts})
    best.plan.notes.insert(
        0,
        f"centring {'kept' if keep else 'left out'} ({len(shifts)} inputs; all-INT8 "
        f"output error {errors[0]:.2e} -> {errors[1]:.2e}; FP32 change {change:.1e})",
    )
    return best


@dataclass
class _Result:
    """One fallback: met within the FLOPs allowed, its INT8 FLOPs share, the plan."""

    met: bool
    share: float
    plan: Int8Plan


def search(
    proto,
    feeds: list[Feed],
    exclude: AbstractSet[str] = frozenset(),
    *,
    target=None,
    evaluation: list[Feed] | None = None,
    search_batches: int = 2,
    residual: bool = True,
    max_fallback: float = MAX_FALLBACK,
    choose: bool = True,
    correct_bias: bool = True,
    equalize: bool = True,
    centre: bool | None = None,
    fp16_parts: bool = False,
) -> Int8Plan:
    """Calibrate on ``feeds``, choose each tensor's range by its cost at the output, rank
    every unit, and keep the fewest out of INT8 until ``target`` holds on ``evaluation``
    (default: the calibration batches). ExportError when the target needs more than
    ``max_fallback`` of the FLOPs out of INT8. ``centre`` (default: only without a target)
    also tries the centred graph: with a target the fallback on it met the detector's
    target on the calibration images with fewer units out, and held less well on images it
    was not fitted on (IoU 0.960 against 0.973; docs/int8.md)."""
    if centre is None:
        centre = target is None
    found = searcher(
        proto,
        feeds,
        exclude,
        search_batches=search_batches,
        residual=residual,
        choose=choose,
        correct_bias=correct_bias,
        equalize=equalize,
        centre=centre,
    )
    if target is None:
        return found.plan
    return found.fallback(target, evaluation, max_fallback, fp16_parts=fp16_parts)


def _fallback(
    plan: Int8Plan,
    switch: Switch,
    evaluation: list[Feed],
    scales,
    max_fallback: float,
    memo: dict | None = None,
    half: Switch | None = None,
) -> bool:
    """Keep the fewest units of ``plan`` out of INT8 that meet its target (``on``, ``kept``,
    ``score``); with ``half`` (``Searcher.half_switch``) each set scored in FP16 too, the
    lesser of the two, unless FP16 misses the target with every unit out. Whether it was
    scored both ways."""
    units, target = plan.units, plan.target
    assert target is not None  # Searcher.fallback sets it
    refs = switch.run(evaluation, np.zeros(len(units)), scales)
    if half is not None:
        all_out = float(target.score(refs, half.run(evaluation, np.zeros(len(units)), scales)))
        if not all_out >= target.threshold:  # FP16 itself misses it (NaN too): no set helps
            plan.notes.append(
                f"with every layer out of INT8 the float parts in FP16 miss the target "
                f"({target.name} {all_out:.4f}), so the fallback scored them in FP32: FP16 "
                "itself needs fixing there (the export patches the graph for FP16 first)"
            )
            half = None
    seen: dict[frozenset, float] = {}  # the growths try some sets again: run each once

    def score(out: set[int]) -> float:
        key = frozenset(out)
        if key not in seen:
            on = np.array([0.0 if i in out else 1.0 for i in range(len(units))])
            seen[key] = target.score(refs, switch.run(evaluation, on, scales))
            if half is not None:  # and as the typed file computes it: the lesser
                seen[key] = lesser(seen[key], target.score(refs, half.run(evaluation, on, scales)))
        return seen[key]

    s = score(set())
    out: set[int] = set()
    # the rank: a task metric's own loss with the unit alone in INT8 (the output error
    # breaks ties); without one, the output error. On PP-OCRv4's detector the IoU rank keeps
    # 8 convs out for IoU 0.967 where the error rank needed 24 for 0.979.
    losses: list[float] | None = None
    alone: list[float] = []
    if s < target.threshold and target.metric is not None:
        # the same metric on the same batches (a ladder of thresholds): measured once
        key = (target.metric, target.name, id(evaluation), half is not None)
        memo = {} if memo is None else memo
        if key not in memo:
            every = set(range(len(units)))
            scored = []
            with _step(f"measuring each layer alone on {target.name}", len(units)) as tick:
                for i in range(len(units)):
                    tick()
                    scored.append(score(every - {i}))
            memo[key] = (evaluation, scored)
        alone = memo[key][1]
        full = target.score(refs, refs)
        # a metric without a finite best (SQNR: inf where INT8 equals FP32) ranks by itself
        losses = [full - a if math.isfinite(full) else -a for a in alone]
    costs = plan.costs
    rank = (lambda i: (-losses[i], -costs[i])) if losses is not None else (lambda i: -costs[i])
    order = sorted(range(len(units)), key=rank)
    if s < target.threshold:
        total = sum(u.flops for u in units) or 1

        def share(out: set[int]) -> float:
            return sum(units[i].flops for i in out) / total

        def grow(order: list[int], tick) -> tuple[set[int], float]:
            # grow the set out of INT8 in steps along ``order`` (1, 2, 4, 8, 16, 24, ...),
            # then try each one back in, cheapest first, and again while one goes back:
            # what stays out is needed (the metric is not monotone: a unit back in can
            # make another one out unneeded)
            k, last, out = 1, s, set()
            while last < target.threshold and k <= len(order):
                out = set(order[:k])
                tick()
                last = score(out)
                if last < target.threshold and share(out) > max_fallback:
                    break  # past the FLOPs allowed and still short: no need to go on
                k = k * 2 if k < 8 else k + 8
            if last < target.threshold and k > len(order):
                out, last = set(order), score(set(order))
            changed = last >= target.threshold
            while changed:
                changed = False
                for i in sorted(out, key=rank, reverse=True):
                    trial = out - {i}
                    tick()
                    t = score(trial)
                    if t >= target.threshold:
                        out, last, changed = trial, t, True
            return out, last

        growing = _step("keeping the costliest layers out until the target holds", None)
        with growing as tick:
            out, last = grow(order, tick)
        if last < target.threshold or share(out) > 0:  # else no set is cheaper
            # the same growth with the rank per FLOP, so a cheap unit (a dense head) goes
            # before a costly conv of about the same loss; the set that meets the target
            # with fewer FLOPs out is kept (easyocr CRAFT: 1.5% of the FLOPs where the
            # loss rank kept 11%)
            loss = losses if losses is not None else costs
            flop = [units[i].flops / total for i in range(len(units))]
            per_flop = sorted(
                range(len(units)),
                key=lambda i: (-loss[i] / max(flop[i], 1e-9), -costs[i] / max(flop[i], 1e-9)),
            )
            if per_flop != order:
                with _step("keeping layers out, the costliest per FLOP first", None) as tick:
                    cand, got = grow(per_flop, tick)
                if (got >= target.threshold, -share(cand), got) > (
                    last >= target.threshold,
                    -share(out),
                    last,
                ):
                    out, last = cand, got
        s = last
    plan.on = [i not in out for i in range(len(units))]
    plan.kept = [
        Kept(
            units[i].node,
            units[i].op,
            costs[i],
            units[i].flops,
            None if losses is None else losses[i],
            None if losses is None else alone[i],
            target.name,
        )
        for i in sorted(out, key=rank)
    ]
    plan.score = s
    return half is not None


def lesser(a: float, b: float) -> float:
    """The lower of two scores, NaN the lowest (``min`` keeps whichever comes first)."""
    return -math.inf if math.isnan(a) or math.isnan(b) else min(a, b)


def shown(score: float, threshold: float) -> str:
    """``score`` with enough digits to tell it from ``threshold`` (0.9999996 is not "1")."""
    for digits in range(4, 13):
        text = f"{score:.{digits}f}"
        # on the side of the threshold the score is (1.0000 is not "< 0.999999")
        read = float(text)
        if score == threshold or (read != threshold and (read < threshold) == (score < threshold)):
            return text
    return repr(score)


def _check(plan: Int8Plan, max_fallback: float) -> None:
    """ExportError (one line: what was reached, what was kept) when the plan misses its
    target or keeps more than ``max_fallback`` of the FLOPs out of INT8."""
    target, s = plan.target, plan.score
    assert target is not None and s is not None
    float_share = 1.0 - plan.int8_flop_share
    if s < target.threshold or float_share > max_fallback:
        kept = "; ".join(map(str, plan.kept[:8])) + (" ..." if len(plan.kept) > 8 else "")
        reached = (
            f"{target.name} {shown(s, target.threshold)} < {target.threshold:.12g}"
            if s < target.threshold
            else f"{target.name} {shown(s, target.threshold)} >= {target.threshold:.12g} only"
        )
        # met with more FLOPs out than allowed: that share allowed keeps this very set
        allow = (
            f"allow that share (export(..., max_fallback={math.ceil(round(float_share * 100, 6)) / 100:g})), "
            if s >= target.threshold and float_share < 1
            else ""
        )
        raise ExportError(
            f"INT8 misses its target: {reached} with {float_share:.1%} of the conv/gemm/matmul "
            f"FLOPs kept out of INT8 (allowed {max_fallback:.0%}; kept: {kept or 'none'}); "
            f"{allow}give more representative calibration batches, lower the target, or export "
            "precision='fp16'"
        )


# ---- the Q/DQ graph ------------------------------------------------------------------------


def write_qdq(proto, plan: Int8Plan):
    """``proto`` (or the plan's equalized copy of it, ``plan.graph``) with Q/DQ at the
    inputs of the plan's units that are on: activations per tensor (symmetric, zero point
    0), weights as INT8 initializers per channel."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(plan.graph if plan.graph is not None else proto)  # equalized, if it was
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    active = {u.node: u for u, on in zip(plan.units, plan.on) if on}
    done: dict[str, str] = {}
    nodes, used_weights = [], set()

    def qdq(t: str) -> list:
        if t in done:
            return []
        s, zp = f"{t}_scale", f"{t}_zero_point"
        g.initializer.extend(
            [
                numpy_helper.from_array(np.array(plan.scales[t], np.float32), s),
                numpy_helper.from_array(np.array(0, np.int8), zp),
            ]
        )
        done[t] = f"{t}_DequantizeLinear_Output"
        return [
            helper.make_node(
                "QuantizeLinear",
                [t, s, zp],
                [f"{t}_QuantizeLinear_Output"],
                name=f"{t}_QuantizeLinear",
            ),
            helper.make_node(
                "DequantizeLinear",
                [f"{t}_QuantizeLinear_Output", s, zp],
                [done[t]],
                name=f"{t}_DequantizeLinear",
            ),
        ]

    for node in g.node:
        u = active.get(node.name)
        if u is not None:
            for t in u.acts:
                nodes += qdq(t)
                for k, name in enumerate(node.input):
                    if name == t:
                        node.input[k] = done[t]
            if u.weight is not None:
                w = u.weight
                if w not in done:
                    q, scale = quantize_weight(
                        numpy_helper.to_array(inits[w]), u.axis, plan.rounded.get(w)
                    )
                    names = (f"{w}_quantized", f"{w}_scale", f"{w}_zero_point")
                    g.initializer.extend(
                        [
                            numpy_helper.from_array(q, names[0]),
                            numpy_helper.from_array(scale, names[1]),
                            numpy_helper.from_array(np.zeros(scale.shape, np.int8), names[2]),
                        ]
                    )
                    done[w] = f"{w}_DequantizeLinear_Output"
                    extra = {"axis": u.axis} if u.axis is not None else {}
                    nodes.append(
                        helper.make_node(
                            "DequantizeLinear",
                            list(names),
                            [done[w]],
                            name=f"{w}_DequantizeLinear",
                            **extra,
                        )
                    )
                node.input[1] = done[w]
                used_weights.add(w)
            corr = plan.corrections.get(node.name)
            if corr is not None:
                bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
                base = (
                    numpy_helper.to_array(inits[bias]) if bias else np.zeros(corr.shape, np.float32)
                )
                name = f"{node.name}_corrected_bias"
                corrected = base.astype(np.float32) + corr.astype(np.float32)  # the switch's sum
                g.initializer.append(numpy_helper.from_array(corrected, name))
                if bias:
                    node.input[2] = name
                    used_weights.add(bias)
                else:
                    node.input.append(name)
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    still = {t for n in g.node for t in n.input} | {o.name for o in g.output}
    kept = [i for i in g.initializer if i.name not in used_weights or i.name in still]
    del g.initializer[:]
    g.initializer.extend(kept)
    return model
