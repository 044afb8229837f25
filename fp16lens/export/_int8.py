"""INT8: explicit Q/DQ in the form TensorRT reads, calibrated and checked at the output.

Q/DQ sit where TensorRT computes in INT8 (``_int8_place``): the inputs of Conv,
ConvTranspose, Gemm and MatMul (activations per tensor, weights per output channel,
symmetric, biases left in float: TensorRT has no INT32 DQ) and the skip input of a
residual Add. Each activation's range is chosen among histogram candidates by its cost at
the model's output, and with a ``target`` the costliest units leave INT8 until it holds
(``_int8_search``). FP32 islands stay unquantized. The activation scales are also written
as a TensorRT calibration cache (TensorRT 10's implicit path).

``calibrator="ort-entropy"`` keeps the former path: ONNX Runtime's ``quantize_static``
(Entropy calibration, Q/DQ on every op), for comparison.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Sized
from pathlib import Path

import numpy as np
import torch

from fp16lens._core import ExportError, import_optional, onnx_large
from fp16lens._core.feeds import feed_items
from fp16lens._core.onnx_types import outer_names, subgraphs
from fp16lens._core.quiet import quiet
from fp16lens.export._artifact import default_opset
from fp16lens.export._calib_cache import write_calibration_cache
from fp16lens.export._int8_search import MAX_FALLBACK

_PURPOSE = "INT8 quantization"
TRT_QDQ_OPTIONS = {
    "ActivationSymmetric": True,
    "WeightSymmetric": True,
    "QuantizeBias": False,
}


def batch_feed(batch, names: list[str], what: str = "calibration") -> dict[str, np.ndarray]:
    """One calibration (or ``what``) item (tensor, tuple of tensors, or dict by input name)
    as an ORT feed."""
    items = feed_items(batch, names, ExportError, f"the model ({what})")
    return {n: _numpy(t) for n, t in items}


def _numpy(t) -> np.ndarray:
    array = t.detach().cpu().numpy() if torch.is_tensor(t) else np.asarray(t)
    return array.astype(np.float32) if array.dtype.kind == "f" else array


def _reader(calibration: Iterable, names: list[str], progress):
    ort_q = import_optional("onnxruntime.quantization", "onnx", _PURPOSE)
    total = len(calibration) if isinstance(calibration, Sized) else None

    class Reader(ort_q.CalibrationDataReader):  # type: ignore[name-defined]  # onnxruntime is not analysed (setup.cfg)
        def __init__(self):
            self._it = iter(calibration)
            self._task = progress.add_task("calibrating INT8", total=total)

        def get_next(self):
            batch = next(self._it, None)
            if batch is None:
                return None
            progress.advance(self._task)
            feed = batch_feed(batch, names)
            shapes = {n: a.shape for n, a in feed.items()}
            self._shapes = getattr(self, "_shapes", shapes)
            if shapes != self._shapes:
                raise ExportError(
                    f"INT8 calibration batches must share one shape per input (Entropy "
                    f"calibration stacks their values): got {_shapes(self._shapes)} then "
                    f"{_shapes(shapes)}; resize or pad the calibration inputs to one shape"
                )
            return feed

    return Reader()


def _shapes(shapes: dict) -> str:
    return ", ".join(f"{n} {tuple(s)}" for n, s in shapes.items())


def _progress():
    from rich.console import Console

    from fp16lens._core.progress import progress_bar as make_bar

    console = Console(stderr=True)
    return make_bar(console, disable=not console.is_terminal)


def prepared(proto):
    """The FP32 graph as the quantizers take it, a copy (``proto`` is left as it is): opset
    >= 13, Constant nodes as initializers, Identity nodes out."""
    onnx = import_optional("onnx", "onnx", _PURPOSE)
    converted = _per_channel_opset(proto)
    if converted is proto:
        converted = onnx.ModelProto()
        converted.CopyFrom(proto)
    proto = converted
    _constants_as_initializers(proto.graph)
    _without_identities(proto.graph)
    return proto


def _feeds(batches: Iterable | None, names: list[str], what: str) -> list[dict[str, np.ndarray]]:
    """The batches as ONNX Runtime feeds. Their shapes may differ where the graph leaves an
    axis free (audio of several lengths, text lines of several widths): the search runs and
    compares each batch on its own, and its statistics are per channel (``_declared``
    checks each batch against the graph)."""
    feeds = [batch_feed(b, names, what) for b in batches] if batches is not None else []
    if batches is not None and not feeds:
        raise ExportError(f"INT8 {what} is empty; pass at least one input batch")
    return feeds


def quantize_fp16lens(
    proto,
    calibration: Iterable,
    exclude=(),
    target=None,
    evaluation=None,
    max_fallback: float = MAX_FALLBACK,
    search_batches: int = 2,
    exported: bool = False,
    fp16_parts: bool = False,
):
    """Quantize the prepared FP32 ``proto`` (``prepared``): (Q/DQ ModelProto, Int8Plan).
    ``exported``: ``proto`` is fp16lens's export of a PyTorch model (a batch that does not
    fit its fixed axes is told how ``dynamic=`` frees them). ``fp16_parts``: the file's
    float parts will be typed FP16, and a target's fallback scores them so too."""
    import_optional("onnxruntime", "onnx", _PURPOSE)
    from fp16lens.export._int8_search import PROGRESS, search, write_qdq

    initializers = {i.name for i in proto.graph.initializer}
    names = [v.name for v in proto.graph.input if v.name not in initializers]
    feeds, split = _split(
        proto, _declared(proto, _feeds(calibration, names, "calibration"), "calibration", exported)
    )
    checks = None if evaluation is None else evaluation_feeds(proto, evaluation, exported)
    with _progress() as progress:  # the search's loops, on stderr in a terminal
        token = PROGRESS.set(progress)
        try:
            plan = search(
                proto,
                feeds,
                set(exclude),
                target=target,
                evaluation=checks,
                max_fallback=max_fallback,
                search_batches=search_batches,
                fp16_parts=fp16_parts,
            )
        finally:
            PROGRESS.reset(token)
    if split:
        plan.notes.insert(0, split)
    quantized = write_qdq(proto, plan)
    if plan.target is not None:
        _check_as_written(proto, quantized, plan, checks or feeds)
    return quantized, plan


def evaluation_feeds(proto, batches: Iterable, exported: bool = False) -> list[dict]:
    """The evaluation (or check) batches as ONNX Runtime feeds of the FP32 graph ``proto``,
    checked against its declared shapes (one batch of N items split where it takes one)."""
    initializers = {i.name for i in proto.graph.initializer}
    names = [v.name for v in proto.graph.input if v.name not in initializers]
    given = _declared(proto, _feeds(batches, names, "evaluation"), "evaluation", exported)
    return _split(proto, given, free=False)[0]


def target_on_file(source, path, batches: Iterable, target) -> float:
    """``target`` (an ``Int8Target``) scored on the INT8 file at ``path`` computed as
    TensorRT runs it (verify's ``onnx-int8``: each Q/DQ on its own, and where the file
    types tensors FP16, their FP16 storage made real) against the FP32 graph ``source``
    (a ModelProto or a path) on ``batches``, as ``_check_as_written`` scores it."""
    from fp16lens.export._int8_search import session
    from fp16lens.verify import backend_spec

    onnx = import_optional("onnx", "onnx", _PURPOSE)
    proto = source if isinstance(source, onnx.ModelProto) else onnx.load(str(source))
    feeds = evaluation_feeds(proto, batches)
    fp32 = session(proto)
    names = [o.name for o in fp32.get_outputs()]
    refs = [fp32.run(names, f) for f in feeds]
    runner = backend_spec("onnx-int8").runner(str(path), None)  # graph outputs in order
    outs = [[_as_fp32(t.numpy()) for t in runner.run((feed,))] for feed in feeds]
    del proto
    return float(target.score(refs, outs))


def _as_fp32(a) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype == np.float16 else a


SPLIT = 8  # batches one calibration batch is split into, at most


def _declared_shapes(proto, feed: dict[str, np.ndarray]) -> dict[str, list[int | None] | None]:
    """Per graph input ``feed`` holds, its declared shape (None: a free axis), or None
    where the graph declares none."""
    return {
        v.name: [d.dim_value if d.dim_value > 0 else None for d in v.type.tensor_type.shape.dim]
        if v.type.tensor_type.HasField("shape")
        else None
        for v in proto.graph.input
        if v.name in feed
    }


def _split(
    proto, feeds: list[dict[str, np.ndarray]], free: bool = True
) -> tuple[list[dict[str, np.ndarray]], str]:
    """One calibration batch of N >= 2 items (``--input cal.npz``) as several, with a note:
    on a graph that takes one item at a time (a first axis of 1), its N items; on a graph
    whose first axis is free, ``min(N, SPLIT)`` parts where the FP32 graph computes on them
    what it computes on the whole (the first axis is the batch, not a sequence). The
    corrections are fitted on some batches and checked on others, and with one batch they
    are not tried at all. ``free=False`` (evaluation batches, which need only to run): only
    on a graph that takes one item at a time."""
    if len(feeds) != 1:
        return feeds, ""
    feed = feeds[0]
    sizes = {a.shape[0] if a.ndim else 0 for a in feed.values()}
    n = sizes.pop() if len(sizes) == 1 else 0
    dims = {shape[0] if shape else -1 for shape in _declared_shapes(proto, feed).values()}
    if n < 2 or dims not in ({None}, {1}) or (dims == {None} and not free):
        return feeds, ""
    parts = [
        {k: a[i] for k, a in feed.items()}
        for i in np.array_split(np.arange(n), n if dims == {1} else min(n, SPLIT))
    ]
    if dims == {1}:
        return (
            parts,
            f"the calibration batch of {n} items split into its items (the graph takes one)",
        )
    if not _same_on_parts(proto, feed, parts):
        return feeds, (
            f"the calibration batch of {n} items kept whole: the FP32 graph computes other "
            "values on parts of it (its outputs mix the items, as a spectrogram in dB below "
            "the batch's max does), so the corrections need it given as several batches"
            if free
            else ""
        )
    return parts, (
        f"the calibration batch of {n} items split into {len(parts)} batches along its first "
        "axis (the FP32 graph computes the same on them), so corrections are fitted on some "
        "and checked on others"
    )


def _same_on_parts(proto, feed: dict[str, np.ndarray], parts: list[dict[str, np.ndarray]]) -> bool:
    """Whether the FP32 graph's outputs on ``parts``, joined, are its outputs on ``feed``."""
    from fp16lens.export._int8_search import session

    sess = session(proto)
    pieces = [sess.run(None, part) for part in parts]
    for j, out in enumerate(sess.run(None, feed)):
        out = np.asarray(out)
        got = [np.asarray(p[j]) for p in pieces]
        if out.ndim == 0 or any(g.ndim != out.ndim or g.shape[1:] != out.shape[1:] for g in got):
            return False
        joined = np.concatenate(got)
        if joined.shape != out.shape:
            return False
        same = (
            np.allclose(joined, out, rtol=1e-3, atol=1e-5 * max(float(np.abs(out).max()), 1e-30))
            if out.dtype.kind == "f"
            else np.array_equal(joined, out)
        )
        if not same:
            return False
    return True


def _declared(
    proto, feeds: list[dict[str, np.ndarray]], what: str, exported: bool = False
) -> list[dict[str, np.ndarray]]:
    """``feeds``, or ExportError (one line: the input, its shape, the graph's) where a batch
    does not fit the shape the graph declares (a single batch's first axis aside where the
    graph's is 1: ``_split`` gives its items)."""
    for k, feed in enumerate(feeds):
        for name, declared in _declared_shapes(proto, feed).items():
            if declared is None:
                continue
            got = feed[name].shape
            one = len(feeds) == 1 and declared[:1] == [1]  # its items, from _split
            want = [None, *declared[1:]] if one else declared
            if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got)):
                shown = "x".join("?" if w is None else str(w) for w in declared)
                which = f" (batch {k + 1} of {len(feeds)})" if len(feeds) > 1 else ""
                raise ExportError(
                    f"INT8 {what} input {name!r} has shape {'x'.join(map(str, got))}{which} "
                    f"where the graph takes {shown}; give batches of that shape (one batch of "
                    "N items along a first axis of 1 is split into its items)"
                    + (_dynamic_hint(want, got) if exported else "")
                )
    return feeds


def _dynamic_hint(want: list, got: tuple) -> str:
    """How a PyTorch model's export leaves the axes that differ free (``dynamic=``: batch,
    dimension 0; sequence, dimension 1 of an input of rank 2-3), where it can."""
    if len(want) != len(got):
        return ""
    differ = {i for i, (w, g) in enumerate(zip(want, got)) if w is not None and w != g}
    names = [
        name
        for name, axes in (("batch", {0}), ("sequence", {1} if len(got) in (2, 3) else set()))
        if differ & axes
    ]
    if not names or differ - {0, *({1} if "sequence" in names else set())}:
        return ""
    if len(names) == 1:
        return f", or export the model with dynamic={names[0]!r}, which leaves that axis free"
    return f", or export the model with dynamic={tuple(names)!r}, which leaves those axes free"


def _check_as_written(proto, quantized, plan, feeds) -> None:
    """The target scored again on the Q/DQ graph as written (each Q/DQ on its own, ONNX
    Runtime with optimizations off) against the FP32 graph the user gave, not the search's
    switch graph: ExportError when the written graph misses it."""
    from fp16lens.export._int8_search import session, shown

    target = plan.target
    fp32, int8 = session(proto), session(quantized)
    names = [o.name for o in fp32.get_outputs()]
    refs = [fp32.run(names, f) for f in feeds]
    outs = [int8.run(names, f) for f in feeds]
    score = target.score(refs, outs)
    plan.notes.append(
        f"checked as written against the FP32 graph: {target.name} {shown(score, target.threshold)}"
    )
    if score < target.threshold:
        raise ExportError(
            f"INT8 misses its target as written: {target.name} {shown(score, target.threshold)} "
            f"< {target.threshold:.12g} on the Q/DQ graph (the search measured "
            f"{shown(plan.score, target.threshold)}); "
            "lower the target, give more representative calibration batches, or export "
            "precision='fp16'"
        )


CALIBRATORS = ("search", "ort-entropy")


def quantize_int8(
    proto,
    calibration: Iterable,
    exclude: list[str],
    path: Path,
    cache_path,
    target=None,
    evaluation=None,
    calibrator: str = "search",
    max_fallback: float | None = None,
    exported: bool = False,
    fp16_parts: bool = False,
):
    """Quantize the FP32 ``proto``; returns (Q/DQ ModelProto, path of the TensorRT cache,
    notes, the search's plan as plain data or None). ``target``: see
    ``_int8_search.Target`` (ExportError when it is not met)."""
    if calibrator not in CALIBRATORS:
        raise ExportError(f"calibrator must be one of {', '.join(CALIBRATORS)}, got {calibrator!r}")
    # the FP32 graph TensorRT 10 builds with the cache keeps its Identity nodes: each of
    # their two names gets the range the search gave the one it kept
    identities = [(n.input[0], n.output[0]) for n in proto.graph.node if n.op_type == "Identity"]
    proto = prepared(proto)
    cache = Path(cache_path) if cache_path else path.with_suffix(".cache")
    notes: list[str] = []
    floors: dict[str, float] = {}
    plan_data = None
    if calibrator == "search":
        from fp16lens.export._int8_place import find_units, name_nodes

        name_nodes(proto.graph)
        if find_units(proto.graph, set(exclude)):
            quantized, plan = quantize_fp16lens(
                proto,
                calibration,
                exclude,
                target,
                evaluation,
                MAX_FALLBACK if max_fallback is None else max_fallback,
                exported=exported,
                fp16_parts=fp16_parts,
            )
            notes.append(plan.summary())
            plan_data = plan.to_dict()
            floors = plan.cache_amax
            notes += _cache_leaves_out(plan, cache.name, plan.graph or proto)
        else:
            quantized = proto
            notes.append(_nothing_to_quantize(proto.graph, exclude))
    else:
        if target is not None:
            raise ExportError("target= needs calibrator='search' (the fallback search)")
        quantized = _quantize_ort(proto, calibration, exclude)
    scales = activation_scales(quantized)
    for t, amax in floors.items():  # a centred tensor, an input on a grid: its range in the
        # FP32 graph TensorRT 10 calibrates with the cache (the Q/DQ graph's would clip it)
        scales[t] = max(scales.get(t, 0.0), amax / 127.0)
    named = True
    while named:  # along a chain of Identities, name by name
        named = False
        for src, dst in identities:
            if (dst in scales) != (src in scales):
                scales[src] = scales[dst] = scales.get(dst, scales.get(src, 0.0))
                named = True
    write_calibration_cache(cache, scales)
    return quantized, cache, notes, plan_data


def _cache_leaves_out(plan, cache: str, graph) -> list[str]:
    """The note (none where the cache carries it all) on what the TensorRT 10 cache named
    ``cache`` cannot carry of ``plan`` (whose units read ``graph``): it holds activation
    ranges for a build from the FP32 graph, where TensorRT rounds the FP32 weights itself
    (over 127 steps), so the weights and constants the search rewrote or stored exactly
    reach TensorRT only through the Q/DQ file, the file checked."""
    from fp16lens.export._int8_search import on_grid

    exact = set(on_grid(graph, plan.units, plan.on)) - set(plan.rounded)
    parts = [
        f"{what} {n} {unit}{'' if n == 1 else 's'}"
        for what, n, unit in (
            ("the fitted codes of", len(plan.rounded), "weight"),
            ("the exact grid of", len(exact), "weight"),
            ("the bias corrections of", len(plan.corrections), "layer"),
            ("the scale migration before", len(plan.equalized), "layer"),
            ("the centring before", len(plan.centred), "layer"),
            ("the input's encoding on the INT8 codes before", len(plan.encoded), "layer"),
        )
        if n
    ]
    if not parts:
        return []
    made = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    return [
        f"the TensorRT 10 calibration cache {cache} holds only the activation ranges, for a "
        f"build from the FP32 graph: it does not carry {made} made here; the accuracy "
        "checked is the Q/DQ file's, which TensorRT 8 and later build as it is"
    ]


def _quantize_ort(proto, calibration: Iterable, exclude: list[str]):
    """ONNX Runtime's quantize_static (Entropy, Q/DQ on every op): the former path."""
    onnx = import_optional("onnx", "onnx", _PURPOSE)
    ort_q = import_optional("onnxruntime.quantization", "onnx", _PURPOSE)
    initializers = {i.name for i in proto.graph.initializer}
    names = [v.name for v in proto.graph.input if v.name not in initializers]
    with tempfile.TemporaryDirectory() as tmp, _progress() as progress, quiet("", stderr=False):
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx_large.save(onnx, proto, src)
        ort_q.quantize_static(
            str(src),
            str(dst),
            _reader(calibration, names, progress),
            quant_format=ort_q.QuantFormat.QDQ,
            per_channel=True,
            activation_type=ort_q.QuantType.QInt8,
            weight_type=ort_q.QuantType.QInt8,
            nodes_to_exclude=exclude,
            calibrate_method=ort_q.CalibrationMethod.Entropy,
            extra_options=dict(TRT_QDQ_OPTIONS),
        )
        return onnx.load(str(dst))


PER_CHANNEL_OPSET = 13
"""DequantizeLinear takes a per-channel ``axis`` from opset 13 on."""


def _per_channel_opset(proto):
    """The graph at opset 13 at least (an ONNX file from paddle2onnx may be opset 11/12)."""
    if default_opset(proto) >= PER_CHANNEL_OPSET:
        return proto
    from onnx import version_converter

    try:
        return version_converter.convert_version(proto, PER_CHANNEL_OPSET)
    except Exception as exc:  # the converter raises RuntimeError/ValueError per op adapter
        raise ExportError(
            f"INT8 with per-channel weights needs opset {PER_CHANNEL_OPSET}, and ONNX's version "
            f"converter cannot bring this opset-{default_opset(proto)} graph there "
            f"({str(exc).splitlines()[0][:200]}); re-export the model at opset >= {PER_CHANNEL_OPSET}"
        ) from exc


def _constants_as_initializers(graph) -> None:
    """Constant nodes become initializers: ONNX Runtime quantizes only initializers as
    weights (per channel), and calibrates a weight held in a Constant node (paddle2onnx
    writes every weight so) as an activation, per tensor."""
    outputs = {o.name for o in graph.output}
    kept = []
    for node in graph.node:
        if (
            node.op_type == "Constant"
            and not node.domain
            and node.output[0] not in outputs
            and [a.name for a in node.attribute] == ["value"]
        ):
            tensor = graph.initializer.add()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)


def _without_identities(graph) -> None:
    """Identity nodes taken out, each wire kept under the Identity's output name where the
    node before it is the only writer and the Identity its only reader, else its readers
    read its input. paddle2onnx (PP-OCRv5) writes one after nearly every op, 191 in the
    recognizer: between a hardswish's affine block and the depthwise conv reading it,
    where the scale migration must see the Mul and Add, and between a conv and its
    residual Add. Kept: one whose output is a graph output or read inside a subgraph."""
    pinned = {o.name for o in graph.output} | {i.name for i in graph.input}
    pinned |= {t for n in graph.node for body in subgraphs(n) for t in outer_names(body)}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in graph.node:
        for t in n.input:
            readers[t] = readers.get(t, 0) + 1
    alias: dict[str, str] = {}  # an Identity's output -> the tensor its readers read

    def source(t: str) -> str:
        while t in alias:
            t = alias[t]
        return t

    kept = []
    for node in graph.node:
        if node.op_type != "Identity" or node.domain or node.output[0] in pinned:
            kept.append(node)
            continue
        src, dst = source(node.input[0]), node.output[0]
        before = producer.get(src)
        if before is not None and readers.get(src) == 1 and src not in pinned:
            before.output[list(before.output).index(src)] = dst  # the wire keeps dst's name
            producer[dst] = before
        else:
            alias[dst] = src
            readers[src] = readers.get(src, 0) - 1 + readers.get(dst, 0)
    for n in kept:
        for k, t in enumerate(n.input):
            if t in alias:
                n.input[k] = source(t)
    del graph.node[:]
    graph.node.extend(kept)


def activation_scales(model) -> dict[str, float]:
    """Tensor -> per-tensor scale of every QuantizeLinear in ``model`` (the activations)."""
    from onnx import numpy_helper

    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    scales = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[1] in consts:
            scale = consts[node.input[1]]
            if scale.size == 1:
                scales[_original_name(node.input[0])] = float(scale.ravel()[0])
    return scales


def _original_name(tensor: str) -> str:
    """ONNX Runtime renames a quantized graph output ``y`` to ``y_QuantizeLinear_Input``."""
    suffix = "_QuantizeLinear_Input"
    return tensor[: -len(suffix)] if tensor.endswith(suffix) else tensor


def _nothing_to_quantize(graph, exclude) -> str:
    """Why a graph gets no Q/DQ: its conv-like nodes are all kept in FP32 or none can be
    placed (a constant first operand), or they lie inside If/Loop/Scan bodies (Silero VAD's whole network is in the branches of its
    sample-rate If), which the placement does not enter, or it has none."""
    from fp16lens._core.onnx_types import subgraphs
    from fp16lens.export._int8_place import COMPUTE_OPS

    def inside(g) -> int:
        return sum(
            (n.op_type in COMPUTE_OPS) + sum(inside(b) for b in subgraphs(n)) for n in g.node
        )

    top = [n for n in graph.node if n.op_type in COMPUTE_OPS]
    holders = [n for n in graph.node if any(inside(b) for b in subgraphs(n))]
    tail = "the graph is written without Q/DQ (export precision='fp16' instead)"
    if top and all(n.name in exclude for n in top):
        return f"INT8: every Conv/ConvTranspose/Gemm/MatMul is in an FP32 island; {tail}"
    if top:
        left = ", ".join(n.name for n in top if n.name not in exclude)
        return (
            f"INT8: no Conv/ConvTranspose/Gemm/MatMul of the graph can be quantized ({left}: "
            f"a constant first operand, MatMul(W, x), is not placed); {tail}"
        )
    if holders:
        count = sum(inside(b) for n in holders for b in subgraphs(n))
        names = ", ".join(f"{n.name or n.output[0]} ({n.op_type})" for n in holders[:3])
        return (
            f"INT8: the graph's {count} Conv/ConvTranspose/Gemm/MatMul nodes all lie inside "
            f"control-flow bodies ({names}), which INT8 placement does not enter; {tail}, or "
            "export a graph without the control flow (a fixed branch) for INT8"
        )
    return f"INT8: the graph has no Conv/ConvTranspose/Gemm/MatMul to quantize; {tail}"
