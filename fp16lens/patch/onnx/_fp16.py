"""The patched ONNX graph in FP16 on the CPU: every stored float tensor rounded to FP16.

A copy of the FP32 graph where each FP32 output of a node that is not an FP32 node
(``fp16lens.fp32_nodes``) goes through Cast(FLOAT16) and Cast(FLOAT) before anyone reads
it (an FP32 node's output too, for the readers that are not FP32 nodes: export casts it
to FP16 for them), the float initializers read by such nodes are rounded to FP16, and so are the float
inputs. ONNX Runtime runs it with its optimizations off, so that no Cast pair is
removed: what a real FP16 runtime stores overflows to inf here too (inside one op the
arithmetic stays FP32, as on a GPU's FP16 kernels that accumulate in FP32).
"""

from __future__ import annotations

import numpy as np
import torch

from fp16lens._core import onnx_large
from fp16lens.patch._check import relative_error
from fp16lens.patch._emulate import FLUSH_SHARE
from fp16lens.patch._plan import BatchProof
from fp16lens.patch._prove import Fp16Runner, admitting
from fp16lens.patch.onnx._graph import onnx_module, read

_FLOAT, _HALF = 1, 10


def fp16_storage(proto, initializers: bool = True):
    """A copy of ``proto`` with FP16 storage emulated (see the module docstring), and the
    rounded tensor of each node in node order: (site, tensor). ``initializers`` False
    leaves the initializers and constants in FP32, each tensor a node writes rounded: an
    INT8 file's float parts as a TensorRT build with FP16 beside INT8 computes them (its
    ONNX parser folds a BatchNormalization into one FP32 scale and shift first)."""
    from fp16lens.patch.onnx._patch import fp32_nodes

    onnx = onnx_module()
    helper, numpy_helper = onnx.helper, onnx.numpy_helper
    keep = set(fp32_nodes(proto))
    fp32_readers: dict[str, list[bool]] = {}  # tensor -> whether each reader stays FP32
    for node in proto.graph.node:
        for t in node.input:
            fp32_readers.setdefault(t, []).append((node.name or node.output[0]) in keep)

    def stored(init):
        if not initializers:
            return None
        if init.data_type != _FLOAT or all(fp32_readers.get(init.name, [False])):
            return None
        with np.errstate(over="ignore"):
            arr = numpy_helper.to_array(init).astype(np.float16).astype(np.float32)
        return numpy_helper.from_array(arr, init.name)

    out = onnx_large.replacing(proto, stored)
    m = read(out, values=False)
    g = out.graph
    nodes, rounded = [], []
    names = {id(n): s for s, n in m.nodes.items()}
    readers: dict[str, list] = {}
    for node in g.node:
        for t in node.input:
            readers.setdefault(t, []).append(node)
    for k, node in enumerate(list(g.node)):
        nodes.append(node)
        if (
            initializers
            and node.op_type == "Constant"
            and not all(fp32_readers.get(node.output[0], [False]))
        ):
            for a in node.attribute:  # a float constant is stored in FP16 too
                if a.name == "value" and a.t.data_type == _FLOAT:
                    with np.errstate(over="ignore"):
                        arr = numpy_helper.to_array(a.t).astype(np.float16).astype(np.float32)
                    a.t.CopyFrom(numpy_helper.from_array(arr, a.t.name))
        if node.op_type == "Constant":
            continue
        if (node.name or node.output[0]) in keep:
            nodes += _handed_to_fp16(helper, node, k, m, readers, keep)
            continue
        for slot, t in enumerate(node.output):
            if not t or m.elem.get(t) != _FLOAT:
                continue
            raw = f"{t}__fp16lens_fp32_{k}"
            node.output[slot] = raw
            half = helper.make_node("Cast", [raw], [f"{t}__fp16lens_fp16_{k}"], to=_HALF)
            back = helper.make_node("Cast", [half.output[0]], [t], to=_FLOAT)
            nodes += [half, back]
            rounded.append((names.get(id(node), node.name or t), t))
    del g.node[:]
    g.node.extend(nodes)
    return out, rounded


def _handed_to_fp16(helper, node, k: int, m, readers: dict, keep: set) -> list:
    """An FP32 node's float outputs as its FP16 readers get them: through a Cast to FP16
    and back (export casts them so), while its FP32 readers keep the FP32 value."""
    casts = []
    for t in node.output:
        halves = [r for r in readers.get(t, []) if (r.name or r.output[0]) not in keep]
        if not t or m.elem.get(t) != _FLOAT or not halves:
            continue
        half, back = f"{t}__fp16lens_to16_{k}", f"{t}__fp16lens_as16_{k}"
        casts += [
            helper.make_node("Cast", [t], [half], to=_HALF),
            helper.make_node("Cast", [half], [back], to=_FLOAT),
        ]
        for r in halves:
            for i, name in enumerate(r.input):
                if name == t:
                    r.input[i] = back
    return casts


def _session(proto):
    from fp16lens.patch.onnx._patch import _session as session

    return session(proto)


def shape_jitter(proto, feed: dict) -> int:
    """Of ``JITTER_DRAWS`` draws of ``feed`` with each float value moved by up to FP16's
    resolution (seeded), how many change an output's shape in FP32 itself (the ONNX twin
    of ``patch._prove.shape_jitter``)."""
    from fp16lens._core.flush import REL_STEP
    from fp16lens.patch._prove import JITTER_DRAWS

    sess = _session(proto)
    shapes = [np.shape(o) for o in sess.run(None, feed)]
    changed = 0
    for seed in range(JITTER_DRAWS):
        rng = np.random.default_rng(seed)
        moved = {
            k: (v * (1 + REL_STEP * rng.uniform(-1, 1, np.shape(v)))).astype(v.dtype)
            if np.issubdtype(np.asarray(v).dtype, np.floating)
            else v
            for k, v in feed.items()
        }
        changed += [np.shape(o) for o in sess.run(None, moved)] != shapes
    return changed


def _round_feed(feed: dict) -> dict:
    """The feed as an FP16 graph receives it (inf where FP16 overflows, said nowhere else)."""
    with np.errstate(over="ignore"):
        return {
            k: (v.astype(np.float16).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v)
            for k, v in feed.items()
        }


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b / (na * nb))


def input_rounding_cosine(original, feed: dict) -> float:
    """The original graph in FP32 on ``feed`` rounded to FP16 against it on ``feed`` (worst
    float output; an input FP16 cannot hold keeps its values): what rounding the input
    alone costs any FP16 run (``patch._prove.input_rounding_cosine`` for a module)."""
    ref = _session(original)
    held = {
        k: r if np.isfinite(r[np.isfinite(feed[k])]).all() else feed[k]
        for k, r in _round_feed(feed).items()
    }
    return _worst_cosine(ref.run(None, feed), ref.run(None, held))


def _worst_cosine(want: list, got: list) -> float:
    """The lowest cosine over the float outputs, on the values finite in both."""
    cos = 1.0
    for a, b in zip(want, got):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.floating):
            if a.shape != b.shape:  # an output's length changed
                return -1.0
            ok = np.isfinite(a) & np.isfinite(b)
            cos = min(cos, _cosine(a[ok], b[ok]))
    return cos


STEP_OPS = ("DynamicQuantizeLinear", "QuantizeLinear", "Floor", "Ceil", "Round")
"""Ops whose output moves by a whole step (an INT8 level, an integer) when their float
input moves by as little as a rounding; a Cast from float to an integer type is one too."""
_INTEGERS = {2, 3, 4, 5, 6, 7, 9, 12, 13}  # ONNX TensorProto: (u)int8/16/32/64, bool


def step_rounding(original, feed: dict) -> tuple[float, dict[str, int]]:
    """The original graph in FP32 with only the float inputs of its step ops (``STEP_OPS``
    and float-to-integer Casts) rounded to FP16, against it in FP32 on ``feed`` (worst
    float output), and how many step ops of each type it holds: what FP16 storage in
    front of those ops alone costs, whatever runs in FP32 around them."""
    onnx = onnx_module()
    helper = onnx.helper
    out = onnx.ModelProto()
    out.CopyFrom(original)
    elem = read(out, values=False).elem
    nodes: list = []
    counts: dict[str, int] = {}
    for k, node in enumerate(list(out.graph.node)):
        step = node.op_type in STEP_OPS or (
            node.op_type == "Cast"
            and any(a.name == "to" and a.i in _INTEGERS for a in node.attribute)
        )
        src = node.input[0] if node.input else ""
        if step and elem.get(src) == _FLOAT:
            half, back = f"{src}__fp16lens_step16_{k}", f"{src}__fp16lens_step32_{k}"
            nodes += [
                helper.make_node("Cast", [src], [half], to=_HALF),
                helper.make_node("Cast", [half], [back], to=_FLOAT),
            ]
            node.input[0] = back
            kind = "float-to-integer Cast" if node.op_type == "Cast" else node.op_type
            counts[kind] = counts.get(kind, 0) + 1
        nodes.append(node)
    if not counts:
        return 1.0, counts
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return _worst_cosine(_session(original).run(None, feed), _session(out).run(None, feed)), counts


def step_reason(
    cosine: float, counts: dict[str, int], min_cosine: float, reached: float
) -> str | None:
    """Why no FP16 run passes a batch when FP16 rounding in front of the graph's step ops
    alone gives ``cosine`` (``step_rounding``); None when that meets ``min_cosine``.
    ``reached``: the cosine the widest patch got, which the advised tolerance admits."""
    if cosine >= min_cosine:
        return None
    ops = ", ".join(f"{n} {op}" for op, n in counts.items())
    return (
        f"rounding only the inputs of its step ops ({ops}) to FP16, the rest in FP32, gives "
        f"cosine {cosine:.6f}: each turns FP16's rounding of its input into a whole step of "
        f"its output, so no FP16 run meets min_cosine {min_cosine} on this batch; run the "
        f"graph in FP32, or patch(..., min_cosine={admitting(cosine, reached)}) accepts "
        "what that costs"
    )


def prove_graph(original, patched, feeds: list[dict]) -> list[BatchProof]:
    """Per batch: the patched graph's FP32 outputs against the original's, and its FP16
    (storage) outputs against the original's FP32 ones; the first node whose rounded
    output is non-finite where it is finite in FP32."""
    same = patched is original  # the graph's own verdict: no FP32 comparison to make
    wants = run_each(original, feeds)  # one session at a time: each holds the weights
    got32s = wants if same else run_each(patched, feeds)
    emulated, rounded = fp16_storage(patched)
    got16s = run_each(emulated, [_round_feed(feed) for feed in feeds])
    out = []
    for k, (feed, want, got32, got16) in enumerate(zip(feeds, wants, got32s, got16s)):
        floats = [i for i, w in enumerate(want) if np.issubdtype(np.asarray(w).dtype, np.floating)]
        fp32_rel = max(
            (
                relative_error(
                    torch.from_numpy(np.asarray(want[i], dtype=np.float64)),
                    torch.from_numpy(np.asarray(got32[i], dtype=np.float64)),
                )
                for i in floats
            ),
            default=0.0,
        )
        p = Fp16Runner.parity(
            [torch.from_numpy(np.asarray(want[i], dtype=np.float64)) for i in floats],
            [torch.from_numpy(np.asarray(got16[i], dtype=np.float64)) for i in floats],
        )
        first = "" if p.finite else _first_nonfinite(emulated, rounded, feed)
        out.append(BatchProof(k, p.finite, p.cosine, p.max_rel, fp32_rel, first, p.shape))
    return out


def run_each(proto, feeds: list[dict]) -> list[list]:
    """``proto``'s outputs on each feed, from one session freed on return (a session holds
    the weights: a large graph's checks run one after another, not side by side)."""
    sess = _session(proto)
    return [sess.run(None, feed) for feed in feeds]


def run_exposed(proto, tensors: list[str], feed: dict) -> dict[str, np.ndarray]:
    """``proto`` run on ``feed`` (rounded to FP16 as an FP16 graph receives it) with
    ``tensors`` exposed as outputs too: every output by name. The outputs are added to
    ``proto`` itself for the session and taken off after (a copy would hold the weights
    again)."""
    onnx = onnx_module()
    outputs = proto.graph.output
    kept = len(outputs)
    have = {o.name for o in outputs}
    try:
        for t in dict.fromkeys(tensors):
            if t not in have:
                outputs.append(onnx.helper.make_empty_tensor_value_info(t))
        sess = _session(proto)
    finally:
        del outputs[kept:]
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, _round_feed(feed))))


def storage_pairs(emulated) -> list[tuple[str, str, str]]:
    """Per stored tensor of an ``fp16_storage`` graph: (the node's site, the tensor as the
    node computed it, as FP16 stores it)."""
    m = read(emulated, values=False)
    names = {id(n): s for s, n in m.nodes.items()}
    producer = {o: n for n in emulated.graph.node for o in n.output}
    back = {n.input[0]: n.output[0] for n in emulated.graph.node if n.op_type == "Cast"}
    out = []
    for node in emulated.graph.node:
        for raw in node.output:
            if "__fp16lens_fp32_" in raw and raw in back and back[raw] in back:
                site = names.get(id(producer[raw]), node.name or raw)
                out.append((site, raw, back[back[raw]]))
        if node.op_type == "Cast" and "__fp16lens_to16_" in node.output[0]:  # FP32 node's
            raw = node.input[0]  # output, as its FP16 readers get it
            up = producer.get(raw)
            site = names.get(id(up), raw) if up is not None else raw
            out.append((site, raw, back[node.output[0]]))
    return out


def _first_nonfinite(emulated, rounded, feed) -> str:
    """The first node (in graph order) whose FP16 output is inf/NaN."""
    values = run_exposed(emulated, [t for _, t in rounded], feed)
    for site, t in rounded:
        v = values.get(t)
        if (
            v is not None
            and np.issubdtype(np.asarray(v).dtype, np.floating)
            and not np.isfinite(v).all()
        ):
            return site
    return ""


def _share(raw: np.ndarray | None, kept: np.ndarray | None) -> float:
    """Of ``raw``'s non-zero values, the share ``kept`` holds as 0 (0 for under 16)."""
    if raw is None or kept is None or not np.issubdtype(raw.dtype, np.floating):
        return 0.0
    live = raw != 0
    n = int(np.count_nonzero(live))
    return int(np.count_nonzero(live & (kept == 0))) / n if n >= 16 else 0.0


def flushing_nodes(proto, feed_: dict) -> tuple[list[tuple[str, float]], list[str]]:
    """(the nodes whose FP16 storage rounds at least ``FLUSH_SHARE`` of their non-zero
    outputs to 0, given FP16 inputs, largest share first: (site, share); the nodes an FP32
    island needs: those, and after each the readers on to the first whose FP32 outputs
    FP16 holds, in graph order)."""
    emulated, _ = fp16_storage(proto)
    pairs = storage_pairs(emulated)  # (site, value before rounding, after)
    values = run_exposed(emulated, [t for _, a, b in pairs for t in (a, b)], feed_)
    out = [(site, _share(values.get(a), values.get(b))) for site, a, b in pairs]
    flushing = sorted(((s, v) for s, v in out if v >= FLUSH_SHARE), key=lambda p: -p[1])
    if not flushing:
        return [], []
    # forward from each flushing node, judged by the FP32 values FP16 would store there
    fp32 = _fp32_values(proto, [site for site, _, _ in pairs], feed_)
    readers: dict[str, list[str]] = {}
    made = {a.split("__fp16lens_fp32_")[0]: site for site, a, _ in pairs}
    for node in proto.graph.node:
        site = node.name or node.output[0]
        for t in node.input:
            if t in made:
                readers.setdefault(made[t], []).append(site)
    island: list[str] = []
    todo = [s for s, _ in flushing]
    while todo:
        site = todo.pop()
        if site in island:
            continue
        island.append(site)
        for nxt in readers.get(site, []):
            v = fp32.get(nxt)
            if v is not None and np.issubdtype(v.dtype, np.floating):
                h = v.astype(np.float16)
                if _share(v, h) >= FLUSH_SHARE:
                    todo.append(nxt)  # still flushing in FP16: on
                    continue
            island.append(nxt)  # back in range: it reads the island's FP32
    order = {n.name or n.output[0]: k for k, n in enumerate(proto.graph.node)}
    return flushing, sorted(dict.fromkeys(island), key=lambda s: order.get(s, len(order)))


def _fp32_values(proto, sites: list[str], feed_: dict) -> dict[str, np.ndarray]:
    """Each node's first float output in FP32, by site."""
    first = {n.name or n.output[0]: n.output[0] for n in proto.graph.node if n.output}
    values = run_exposed(proto, [first[s] for s in sites if s in first], feed_)
    return {s: values[first[s]] for s in sites if s in first and first[s] in values}
