"""patch() of an ONNX graph: the PyTorch planner over an ``OnnxBinding``, the plan applied
to a copy of the graph, then checked: ``onnx.checker`` (full check) and the FP32 outputs of
the original and the patched graph in ONNX Runtime (within ``TOLERANCE``). Where that check
fails, the span involved is kept FP32 (its nodes in ``fp16lens.fp32_nodes``) instead of
refusing; with batches the patched graph is proven in FP16 (``_fp16.py``)."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp16lens._core import PatchError, StaleReportError, import_optional, onnx_large
from fp16lens._core.feeds import as_input, feed_items
from fp16lens._core.fingerprint import onnx_changed
from fp16lens._core.onnx_types import FP32_NODES_KEY, check_graph
from fp16lens._core.onnx_upcast import TWIN_KEY
from fp16lens._core.sites import Mechanism
from fp16lens.patch._check import NOT_CHECKED, relative_error, report_batch
from fp16lens.patch._check import TOLERANCE as AFFINE_TOLERANCE
from fp16lens.patch._options import PatchOptions
from fp16lens.patch._plan import INPUT_CAUSE, PROOF_SITE, Island, Plan, Unresolved
from fp16lens.patch._planner import build_plan
from fp16lens.patch.onnx._apply import apply
from fp16lens.patch.onnx._binding import OnnxBinding
from fp16lens.patch.onnx._branches import fold_branches
from fp16lens.patch.onnx._flops import graph_flops
from fp16lens.patch.onnx._graph import (
    FLOAT_TYPES,
    OnnxModel,
    load,
    onnx_module,
    read,
)
from fp16lens.patch.onnx._underflow import underflow_islands
from fp16lens.report import Report

TOLERANCE = 1e-6
"""Relative to each output's largest |value|: rescaling by powers of two is exact. It is
checked against the original with its batch norms in affine form (when the plan has any):
that form rounds once in FP32, which layers after it can amplify beyond 1e-6 (1e-4 at most,
``patch/_check.py``'s tolerance, is what the affine form alone is held to)."""


def fp32_nodes(proto) -> list[str]:
    """The node names an FP16 export of ``proto`` keeps in FP32 (``metadata_props``)."""
    for p in proto.metadata_props:
        if p.key == FP32_NODES_KEY:
            return list(json.loads(p.value))
    return []


def plan_onnx(model: Any, report: Report, options: PatchOptions) -> Plan:
    """What patch_onnx() would do; nothing is changed."""
    original = load(model, copy=False)  # only read: apply, which changes a graph, is not run
    structure = onnx_large.light(original)  # what the FLOP count reads (names, shapes)
    the_plan = _plan(read(original), report, options)[0]
    _count_flops(the_plan, structure, report)
    return the_plan


def _count_flops(the_plan: Plan, original, report: Report) -> None:
    """The plan's FP16 FLOP share: the graph's own FP32 nodes and the plan's kept FP32."""
    the_plan.fp16_flops, the_plan.total_flops = graph_flops(
        original, report, [*fp32_nodes(original), *the_plan.fp32_modules]
    )


def _twin_note(the_plan: Plan, original) -> None:
    """Where the source computes in float16, the plan says the graph written is its FP32
    twin, patched or not, and how to make it FP16 again."""
    if any(p.key == TWIN_KEY for p in original.metadata_props):
        the_plan.notes.append(
            "the source computes in float16: the patched graph is its FP32 twin (float32 "
            "throughout, the file's own FP32 nodes named as islands); turn it into FP16 with "
            "fp16lens export --precision fp16, which checks the file it writes"
        )


def patch_onnx(
    model: Any,
    report: Report,
    options: PatchOptions,
    out: str | Path | None = None,
    batches: Sequence | None = None,
) -> tuple[Any, Plan]:
    """The patched graph (a new ModelProto) and its plan; written to ``out`` when given.
    The FP32 check runs on ``batches`` (else on inputs like the report's recorded ones).
    Where it fails (a rescaled tensor reaches an output by a path the report's dataflow
    does not show), the rescaling of the span involved is reverted and its nodes become
    FP32 nodes (named in the plan); with ``batches`` the patched graph also runs in FP16
    (FP16 storage of every stored tensor, ``_fp16.py``) and failing spans become FP32
    nodes likewise, until it passes or nothing is left."""
    onnx = onnx_module()
    original = load(model)
    _require(original, report)
    feeds = None
    if options.check:
        feeds = _feeds(original, batches) if batches is not None else _inputs(original, report)
    drop: tuple[int, ...] = ()
    m, the_plan, binding = _attempt(original, report, options, drop)
    if not the_plan.changes and batches is None:  # a clean graph stays as it was
        _twin_note(the_plan, original)
        if out is not None:
            onnx_large.save(onnx, original, out)
        return original, the_plan
    if options.check and feeds:
        m, the_plan, binding, drop = _fp32_checked(
            original, report, options, feeds, m, the_plan, binding
        )
    elif options.check:
        the_plan.notes.append(
            f"{NOT_CHECKED}: the report holds no inputs for the graph's inputs (pass batches=)"
        )
    m.consts.clear()  # planned and applied: what follows reads m.proto, a large graph's weights
    del binding
    if batches is not None:
        m, the_plan = _proven(
            original, report, options, feeds or _feeds(original, batches), m, the_plan, drop
        )
    elif the_plan.changes:
        m, the_plan = _statistics(original, report, options, feeds, m, the_plan, drop)
        the_plan.notes.append(
            "the FP16 check did not run (no batches): the patched graph was not run in FP16; pass "
            "batches= (or --input) to prove it"
        )
    _count_flops(the_plan, original, report)
    _twin_note(the_plan, original)
    if out is not None:
        onnx_large.save(onnx, m.proto, out)
    return m.proto, the_plan


def _attempt(original, report: Report, options: PatchOptions, drop: tuple[int | str, ...]):
    """Plan and apply with the spans ``drop`` (indices; -1: every span and finding) not
    rescaled: their nodes are FP32 nodes instead. Returns the patched model, plan, binding."""
    onnx = onnx_module()
    m = read(load(original))
    planned, fp32_sites = _without(fold_branches(m, report), drop)  # a branch's sites: its If
    the_plan, binding = _plan(m, planned, options)
    have = {i.module for i in the_plan.islands}
    for site, why in fp32_sites.items():
        if site in m.nodes and site not in have and site not in binding.units:
            the_plan.islands.append(Island(site, 1.0, 1.0, why))
    if not the_plan.changes:
        return m, the_plan, binding
    fp32 = apply(m, the_plan, binding.units)
    if fp32:
        set_fp32_nodes(m.proto, [*fp32_nodes(original), *fp32])
    try:
        check_graph(onnx, m.proto, original)
    except Exception as exc:
        raise PatchError(
            f"the patched graph fails onnx.checker ({str(exc).splitlines()[0][:300]}); the "
            "model was left untouched: please report it with the model's op types"
        ) from exc
    return m, the_plan, binding


def _without(report: Report, drop: tuple[int | str, ...]) -> tuple[Report, dict[str, str]]:
    """``report`` without the spans ``drop`` (indices; and the findings at their sites)
    and the findings ``drop`` names (``"finding SITE"``), and the sites to keep FP32
    instead, with why. -1 in ``drop``: no span and no finding."""
    if not drop:
        return report, {}
    out = copy.deepcopy(report)
    everything = -1 in drop
    gone = [s for i, s in enumerate(report.spans) if everything or i in drop]
    sites: dict[str, str] = {}
    for s in gone:
        for x in s.sites:
            sites.setdefault(
                x,
                f"span {s.start} -> {s.end or 'output'}: its rescaling failed the check; kept FP32",
            )
    out.spans = [s for i, s in enumerate(report.spans) if not (everything or i in drop)]
    kept = []
    for f in report.findings:
        if f.mechanism == Mechanism.NOTE or (f.mechanism == Mechanism.UNDERFLOW and not everything):
            kept.append(f)  # an underflow island is not a rescaling: it stays with its block
        elif everything or f.site in sites or f"finding {f.site}" in drop:
            sites.setdefault(
                f.site,
                f"{f.kind or f.mechanism} at {f.site}: its rescaling failed the check; kept FP32",
            )
        else:
            kept.append(f)
    out.findings = kept
    for d in drop:  # nodes whose FP16 storage flushes what reaches the outputs
        if isinstance(d, str) and d.startswith(_FLUSH_KEY):
            sites.setdefault(
                d[len(_FLUSH_KEY) :],
                "FP16 storage rounds its non-zero values to 0 (or it reads them): kept FP32",
            )
    return out, sites


_FLUSH_KEY = "flush "


def _fp32_checked(original, report, options, feeds, m, the_plan, binding):
    """The FP32 check; on a mismatch, each span reverted to FP32 nodes in turn (then all)
    until it passes. The plan names the nodes and says why."""
    try:
        _checks(original, m.proto, the_plan, binding, feeds, report)
        the_plan.fp32_checked = True
        return m, the_plan, binding, ()
    except PatchError as exc:
        first = str(exc)
    findings = [f"finding {f.site}" for f in report.findings if f.mechanism != Mechanism.NOTE]
    drops: list[tuple[int | str, ...]] = [
        *((i,) for i in range(len(report.spans))),
        *((f,) for f in dict.fromkeys(findings)),
        (-1,),
    ]
    for drop in drops:
        m2, plan2, binding2 = _attempt(original, report, options, drop)
        try:
            _checks(original, m2.proto, plan2, binding2, feeds, report)
        except PatchError:
            continue
        nodes = [i.module for i in plan2.islands if i.reason.endswith("kept FP32")]
        plan2.fp32_checked = True
        plan2.notes.append(
            f"the rescaled graph failed the FP32 check ({first.split(':')[0]}); reverted the rescaling "
            f"of {'every span' if drop == (-1,) else _what(report, drop[0])} and kept its nodes FP32: "
            f"{', '.join(nodes) or 'none'}"
        )
        return m2, plan2, binding2, drop
    raise PatchError(first)


def _statistics(original, report, options, feeds, m, the_plan, drop):
    """Without batches: an island whose recorded output is beyond FP16 hands inf on; its
    span becomes FP32 nodes (when the FP32 check still passes), else it is unresolved."""
    from fp16lens.patch._prove import spans_for_sites, statistics_problems

    problems = statistics_problems(the_plan, report)
    new = [i for i in spans_for_sites(report, [s for s, _ in problems]) if i not in drop]
    if new:
        nxt = tuple(dict.fromkeys([*[d for d in drop if d != -1], *new]))
        m2, plan2, binding2 = _attempt(original, report, options, nxt)
        try:
            if feeds:
                _checks(original, m2.proto, plan2, binding2, feeds, report)
            plan2.fp32_checked = the_plan.fp32_checked
            plan2.notes = [
                *the_plan.notes,
                f"islands hand on values beyond FP16 (the report's ranges): kept "
                f"{', '.join(_what(report, i) for i in new)} as FP32 nodes",
            ]
            m, the_plan = m2, plan2
        except PatchError:
            pass
    covered = {
        i.module for i in the_plan.islands if i.reason.endswith("kept FP32")
    }  # whole spans FP32
    for site, value in statistics_problems(the_plan, report):
        if site not in covered:
            the_plan.unresolved.append(
                Unresolved(
                    site,
                    (
                        f"its FP32 island hands on {value:.3g} (the report's range), beyond FP16: pass batches= "
                        "(--input) to prove and widen the fix"
                    ),
                )
            )
    return m, the_plan


def _flush_islands(original, report, options, feeds, m, the_plan, drop, worst):
    """Where real FP16 of the patched graph is finite but short and its storage rounds
    non-zero values to 0 (``flushing_nodes``): those nodes and their readers up to where
    the values are back in range become FP32 nodes; the patch with them when it passes
    on every batch (else None). DNSMOS-like: a square of small values times a gain."""
    from fp16lens.patch._prove import passes
    from fp16lens.patch.onnx._fp16 import flushing_nodes, prove_graph

    flushing, island = flushing_nodes(m.proto, feeds[worst.batch])
    if not island:
        return None
    nxt = tuple(dict.fromkeys([*drop, *(_FLUSH_KEY + s for s in island)]))
    m2, plan2, binding2 = _attempt(original, report, options, nxt)
    try:
        _checks(original, m2.proto, plan2, binding2, feeds, report)
    except PatchError:
        return None
    proof = prove_graph(original, m2.proto, feeds)
    if not all(passes(b, options) for b in proof):
        return None
    plan2.proof, plan2.fp16_checked, plan2.fp32_checked = proof, True, True
    names = ", ".join(f"{s} ({100 * share:.3g}%)" for s, share in flushing[:4])
    plan2.notes = [
        *the_plan.notes,
        f"real FP16 was finite but short ({worst.failure()}): FP16 storage rounds "
        f"non-zero values to 0 at {names}; kept FP32 from there to where the values are "
        f"back in range: {', '.join(island)}",
    ]
    return m2, plan2


def _what(report: Report, key) -> str:
    if isinstance(key, str):
        return key.replace("finding ", "the finding at ")
    s = report.spans[key]
    return f"span {s.start} -> {s.end or 'output'}"


def _proven(original, report, options, feeds, m, the_plan, drop):
    """The patched graph in FP16 (storage of every float tensor rounded) on the batches;
    failing spans become FP32 nodes (one more per round, then all) until it passes."""
    from fp16lens.patch._prove import passes, standing, worst_first
    from fp16lens.patch.onnx._fp16 import prove_graph

    tried = set()
    best = None  # the round that read best so far: (standing, m, plan, drop, failed)
    rounds = max(1, options.max_rounds)
    for k in range(rounds + 1):
        proof = prove_graph(original, m.proto, feeds)
        the_plan.proof, the_plan.fp16_checked = proof, True
        failed = sorted((b for b in proof if not passes(b, options)), key=worst_first)
        if not failed:
            return m, the_plan
        if best is None or standing(proof) <= best[0]:  # ties: the wider, as before
            best = (standing(proof), m, the_plan, drop, failed)
        bad = [b.first_nonfinite for b in failed if b.first_nonfinite]
        spans = [i for i, s in enumerate(report.spans) if any(x in s.sites for x in bad)]
        new = [i for i in spans if i not in drop]
        if k == rounds:
            break
        if new:
            nxt = tuple(dict.fromkeys([*[d for d in drop if d != -1], new[0]]))
        elif -1 not in drop:
            nxt = (-1,)
        else:
            break
        if nxt in tried:
            break
        tried.add(nxt)
        m2, plan2, binding2 = _attempt(original, report, options, nxt)
        try:
            _checks(original, m2.proto, plan2, binding2, feeds, report)
        except PatchError:
            break
        plan2.fp32_checked = True
        plan2.notes = [
            *the_plan.notes,
            f"real FP16 failed ({failed[0].failure()}); kept "
            f"{'every span' if nxt == (-1,) else 'spans ' + ', '.join(map(str, nxt))} as FP32 nodes",
        ]
        m, the_plan, drop = m2, plan2, nxt
    wider = ""
    if best is not None and best[1] is not m:
        # a wider round read worse than an earlier one: that one is returned
        _, m, kept, drop, first = best
        wider = (
            f"keeping more of the graph FP32 reads worse in FP16 ({failed[0].failure()} on "
            f"batch {failed[0].batch})"
        )
        kept.notes = [*kept.notes, f"{wider}: the patch with {_kept(drop)} is returned"]
        the_plan, failed = kept, first
    worst = failed[0]
    if worst.finite:  # finite and short: do FP16's flushes reach the outputs?
        flushed = _flush_islands(original, report, options, feeds, m, the_plan, drop, worst)
        if flushed is not None:
            return flushed
    from fp16lens.patch._prove import (
        admitting,
        input_range_reason,
        rounding_reason,
        shape_reason,
    )
    from fp16lens.patch.onnx._fp16 import (
        input_rounding_cosine,
        shape_jitter,
        step_reason,
        step_rounding,
    )

    # finite, short of the tolerance: is it the input's own rounding?
    rounding = worst.finite and rounding_reason(
        input_rounding_cosine(original, feeds[worst.batch]), options.min_cosine, worst.cosine
    )
    beyond = None if rounding else input_range_reason(feeds[worst.batch])
    # finite and short with every span FP32: FP16 in front of a step op (a quantizer)?
    steps = (
        worst.finite
        and not (rounding or beyond)
        and step_reason(
            *step_rounding(original, feeds[worst.batch]), options.min_cosine, worst.cosine
        )
    )
    precision = (
        worst.finite
        and not worst.shape
        and (
            "real FP16 of the patched graph is finite, short only in precision (FP16 keeps 11 "
            "significant bits, which no island around a span changes); run the graph in FP32, "
            f"or patch(..., min_cosine={admitting(worst.cosine)}) accepts what that costs"
        )
    )
    jittered = shape_jitter(original, feeds[worst.batch]) if worst.shape else 0
    why = (
        shape_reason(worst, jittered)
        or rounding
        or beyond
        or steps
        or precision
        or "the graph is not FP16-safe; run it in FP32"
    )
    the_plan.unresolved.append(
        Unresolved(
            PROOF_SITE,
            (
                f"the patched graph in FP16 still fails on batch {worst.batch} "
                f"({worst.failure()}) "
                f"{'with every span kept FP32' if drop == (-1,) else 'with ' + _kept(drop)}"
                f"{'; ' + wider if wider else ''}: {why}"
            ),
            INPUT_CAUSE if beyond else "",
        )
    )
    return m, the_plan


def _kept(drop: tuple) -> str:
    if not drop:
        return "every span rescaled"
    return "spans " + ", ".join(map(str, drop)) + " kept as FP32 nodes"


def _plan(m: OnnxModel, report: Report, options: PatchOptions):
    _require(m.proto, report)
    report = fold_branches(m, report)
    binding = OnnxBinding(m, set(fp32_nodes(m.proto)))
    the_plan = build_plan(None, report, options, binding)
    taken = {i.module for i in the_plan.islands} | set(fp32_nodes(m.proto))
    the_plan.islands.extend(underflow_islands(m, report, taken))
    the_plan.aliases = binding.aliases()
    return the_plan, binding


def set_fp32_nodes(proto, names: list[str]) -> None:
    """``proto``'s FP32 nodes (``FP32_NODES_KEY``) made ``names``, each once."""
    for i, p in enumerate(proto.metadata_props):
        if p.key == FP32_NODES_KEY:
            del proto.metadata_props[i]
            break
    entry = proto.metadata_props.add()
    entry.key, entry.value = FP32_NODES_KEY, json.dumps(list(dict.fromkeys(names)))


def _require(proto, report: Report) -> None:
    if not isinstance(report, Report):
        raise PatchError(
            f"patch needs a fp16lens Report, got {type(report).__name__}; create one with "
            "fp16lens.scan('model.onnx', batches) or load one with fp16lens.Report.load(path)"
        )
    stale = onnx_changed(report.meta.weights, proto)
    if stale:
        raise StaleReportError(
            f"the report was made from other initializers than this graph's ({', '.join(stale[:3])} "
            "changed since it was scanned), so its ranges do not apply: scan this model again "
            "(fp16lens.scan or `fp16lens scan`) and patch with the new report"
        )


def _inputs(m_proto, report: Report) -> list[dict[str, np.ndarray]]:
    onnx = onnx_module()
    inits = {i.name for i in m_proto.graph.initializer}
    graph_inputs = [i for i in m_proto.graph.input if i.name not in inits]
    recorded = report_batch(report)  # inputs like the recorded ones (dtypes, ranges)
    if isinstance(recorded, dict) and all(vi.name in recorded for vi in graph_inputs):
        return [
            {
                vi.name: np.asarray(recorded[vi.name].numpy()).astype(
                    onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
                )
                for vi in graph_inputs
            }
        ]
    shapes = report.meta.input_shapes[0] if report.meta.input_shapes else None
    if shapes is None or len(shapes) != len(graph_inputs):
        return []
    rng = np.random.default_rng(0)
    feed = {}
    for vi, shape in zip(graph_inputs, shapes):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feed[vi.name] = (
            rng.random(shape).astype(dtype)
            if vi.type.tensor_type.elem_type in FLOAT_TYPES
            else np.zeros(shape, dtype=dtype)
        )
    return [feed]


def _feeds(proto, batches) -> list[dict[str, np.ndarray]]:
    inits = {i.name for i in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in inits]
    elem = {i.name: i.type.tensor_type.elem_type for i in inputs}
    out = []
    for batch in batches:
        items = feed_items(batch, list(elem), PatchError, "the ONNX model")
        out.append({n: as_input(a, elem[n]) for n, a in items})
    return out


def _session(proto):
    ort = import_optional("onnxruntime", "onnx", "checking a patched ONNX model")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return onnx_large.session(ort, proto, so)


def _output_floors(original, report: Report | None) -> list[float]:
    """Per graph output, the largest |value| the report recorded at the node producing it
    (0 when unknown): the scale an error is measured against, so that an output that is
    nearly 0 on inputs like the recorded ones (a saturated sigmoid on random pixels) does
    not make rounding in the 7th digit look like a wrong rewrite."""
    if report is None:
        return []
    m = read(original, values=False)  # loaded already: the same sites
    site_of = {id(n): s for s, n in m.nodes.items()}
    out = []
    for o in original.graph.output:
        node = m.producer.get(o.name)
        st = report.sites.get(site_of.get(id(node), "")) if node is not None else None
        out.append(st.absmax if st is not None and np.isfinite(st.absmax) else 0.0)
    return out


def _checks(
    original, patched, the_plan: Plan, binding, feeds, report: Report | None = None
) -> list[str]:
    floors = _output_floors(original, report)
    affine = [r for r in the_plan.reparametrized if r.rule == "bn-affine"]
    if affine:  # the affine forms alone, then the rescaling exact against them
        m = read(load(original))
        apply(
            m,
            Plan(reparametrized=[dataclasses.replace(r, s_in=1.0, s_out=1.0) for r in affine]),
            binding.units,
        )
        _check(original, m.proto, feeds, AFFINE_TOLERANCE, floors)
        original = m.proto
    _check(original, patched, feeds, TOLERANCE, floors)
    return []


def _check(original, patched, feeds, tolerance: float, floors=()) -> None:
    from fp16lens.patch.onnx._fp16 import run_each

    wants, gots = run_each(original, feeds), run_each(patched, feeds)
    for want, got in zip(wants, gots):
        for i, (x, y) in enumerate(zip(want, got)):
            if not np.issubdtype(np.asarray(x).dtype, np.floating):
                continue
            floor = floors[i] if i < len(floors) else 0.0
            err = relative_error(
                torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y)), floor
            )
            if not err <= tolerance:
                raise PatchError(
                    f"the patched graph's FP32 output {i} differs from the original's (relative "
                    f"error {err:.3g} > {tolerance:g}): a rescaled tensor reaches it by a path the "
                    "report's dataflow does not show; nothing was written. Keep the affected "
                    "nodes in FP32 instead"
                )
