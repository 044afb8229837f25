"""scan() of ONNX graphs with If nodes: the taken branch is scanned, inlined per batch.

Small graphs built with onnx.helper. Ground truth is a real FP16 run
(``zoo_real.onnx_real_fp16``: every stored tensor through a Cast to FP16, in ONNX Runtime)
of the same graph with the branch the batch takes written straight into the main graph by
this file's builder (``flat=``), so every tensor can be returned and the first node holding
inf named, without fp16lens. (ONNX Runtime's CPU kernels run an FP16 graph's Muls in FP32,
so a graph typed FP16 would hide the overflow.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens._core import PatchError  # noqa: E402
from fp16lens._core.sites import FindingKind, Mechanism  # noqa: E402
from fp16lens.report._advice import suggest_fix  # noqa: E402
from fp16lens.watch.onnx import _variants  # noqa: E402

F32 = TensorProto.FLOAT
X = np.full((2, 4), 100.0, np.float32)  # x 1024 = 102400 > 65504
SMALL = np.full((2, 4), 1.0, np.float32)


def _c(name: str, value):
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _vi(name: str, elem: int = F32):
    return helper.make_tensor_value_info(name, elem, [2, 4])


def _branch(nodes, out: str, inits, name: str):
    return helper.make_graph(nodes, name, [], [_vi(out)], initializer=inits)


def _amp(h: str, tag: str):
    """h x 1024 (``gain``: an outer initializer) then / 1024 (``shrink_by``: the branch's own)."""
    return (
        [
            helper.make_node("Mul", [h, "gain"], [f"{tag}big"], name="amp"),
            helper.make_node("Mul", [f"{tag}big", f"{tag}shrink_by"], [f"{tag}out"], name="shrink"),
        ],
        f"{tag}out",
        [_c(f"{tag}shrink_by", 1 / 1024)],
    )


def _half(h: str, tag: str):
    return (
        [helper.make_node("Mul", [h, f"{tag}half_c"], [f"{tag}out"], name="half")],
        f"{tag}out",
        [_c(f"{tag}half_c", 0.5)],
    )


def _flat(nodes, prefix: str, out: str, target: str):
    """A branch written into the main graph by hand: nodes named as the scan names them."""
    copies = []
    for n in nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = prefix + n.name
        copies.append(c)
    return [*copies, helper.make_node("Identity", [out], [target], name=prefix + "out")]


def _model(nodes, inputs, out: str, inits):
    g = helper.make_graph(nodes, "ifs", inputs, [_vi(out)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def gate(flat: bool | None = None, lift: str = ""):
    """x -> Relu ``pre`` -> If ``gate`` on the input ``flag`` (then: x1024 /1024, else: x0.5)
    -> Add ``post`` with x. A span in the main graph instead of the Relu: ``lift="down"``,
    MatMuls x1024 ``up`` and /1024 ``down``; ``lift="relu"``, MatMul ``up`` (x-1024 on the
    first column) and Relu ``act``, read by the If's branches."""
    then, els = _amp("h", "t_"), _half("h", "e_")
    pre = helper.make_node("Relu", ["x"], ["h"], name="pre")
    if lift:
        up = np.diag([-1024.0, 1, 1, 1]) if lift == "relu" else np.eye(4) * 1024
        pre = [
            helper.make_node("MatMul", ["x", "w_up"], ["u"], name="up"),
            helper.make_node("MatMul", ["u", "w_down"], ["h"], name="down")
            if lift == "down"
            else helper.make_node("Relu", ["u"], ["h"], name="act"),
        ]
        lifts = [_c("w_up", up), *([_c("w_down", np.eye(4) / 1024)] if lift == "down" else [])]
    post = helper.make_node("Add", ["g", "x"], ["y"], name="post")
    if flat is None:
        ifn = helper.make_node(
            "If",
            ["flag"],
            ["g"],
            name="gate",
            then_branch=_branch(*then, "then"),
            else_branch=_branch(*els, "else"),
        )
        body, inits = [ifn], []
    else:
        nodes, o, inits = then if flat else els
        body = _flat(nodes, f"gate/{'then' if flat else 'else'}/", o, "g")
    inputs = [_vi("x"), helper.make_tensor_value_info("flag", TensorProto.BOOL, [])]
    pre = pre if lift else [pre]
    return _model(
        [*pre, *body, post], inputs, "y", [_c("gain", 1024), *inits, *(lifts if lift else [])]
    )


def nested(flat: bool | None = None):
    """If ``route`` on ``flag``; its then branch tests max(h) > 10 (h: an outer tensor,
    ``ten``: the branch's initializer) in an inner If ``inner`` whose then branch is x1024
    /1024; every other branch passes h on. ``flat``: route's then branch and inner's
    ``flat`` branch written into the main graph."""
    inner_then = _amp("h", "it_")
    inner_else = ([helper.make_node("Identity", ["h"], ["ie_out"], name="pass")], "ie_out", [])
    test = [
        helper.make_node("ReduceMax", ["h"], ["m"], name="max", keepdims=0),
        helper.make_node("Greater", ["m", "ten"], ["big"], name="test"),
    ]
    pre = helper.make_node("Relu", ["x"], ["h"], name="pre")
    inputs = [_vi("x"), helper.make_tensor_value_info("flag", TensorProto.BOOL, [])]
    if flat is not None:
        nodes, o, inits = inner_then if flat else inner_else
        body = _flat(
            [*test, *_flat(nodes, f"inner/{'then' if flat else 'else'}/", o, "r_out")],
            "route/then/",
            "r_out",
            "y",
        )
        return _model([pre, *body], inputs, "y", [_c("gain", 1024), _c("ten", 10), *inits])
    inner = helper.make_node(
        "If",
        ["big"],
        ["r_out"],
        name="inner",
        then_branch=_branch(*inner_then, "it"),
        else_branch=_branch(*inner_else, "ie"),
    )
    route = helper.make_node(
        "If",
        ["flag"],
        ["y"],
        name="route",
        then_branch=_branch([*test, inner], "r_out", [_c("ten", 10)], "rt"),
        else_branch=_branch(
            [helper.make_node("Identity", ["h"], ["re_out"], name="pass")], "re_out", [], "re"
        ),
    )
    return _model([pre, route], inputs, "y", [_c("gain", 1024)])


def _feed(x: np.ndarray, flag: bool) -> dict:
    return {"x": x, "flag": np.array(flag)}


def _truth(model, feed: dict, tmp_path) -> tuple[np.ndarray, str | None]:
    """(the output under real FP16 storage, the first node in graph order whose output
    holds inf): ``zoo_real.onnx_real_fp16``, every stored tensor through a Cast to FP16."""
    path = tmp_path / "flat.onnx"
    onnx.save(model, str(path))
    order = [(n.name, o) for n in model.graph.node for o in n.output]
    got = zoo_real.onnx_real_fp16(str(path), feed, tuple(o for _, o in order))
    first = next((n for n, o in order if o in got and not np.isfinite(got[o]).all()), None)
    return got[model.graph.output[0].name], first


def _session(model):
    """ONNX Runtime with graph optimizations off (they fold x1024 /1024 into one Mul)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _fp32(model, feed: dict) -> np.ndarray:
    return _session(model).run(None, feed)[0]


def _inlined_note(report) -> str:
    [note] = [f for f in report.findings if "inlined" in f.detail]
    assert note.mechanism == Mechanism.NOTE and note.kind == FindingKind.INLINED
    return note.detail


def test_branch_that_overflows_taken_is_seen_where_real_fp16_overflows(tmp_path):
    report = fp16lens.scan(gate(), [_feed(X, True)], progress=False)
    out16, first = _truth(gate(flat=True), _feed(X, True), tmp_path)
    assert np.isfinite(_fp32(gate(), _feed(X, True))).all() and not np.isfinite(out16).all()
    assert not report.clean
    [span] = report.spans
    assert span.start == first == "gate/then/amp" and span.peak == 102400
    assert span.end == "gate/then/shrink" and report.sites[span.start].op == "Mul"
    assert {"pre", "gate/then/amp", "gate/then/shrink", "post"} <= set(report.sites)
    assert "gate (then, 1 batch)" in _inlined_note(report)
    assert not any(f.kind == FindingKind.UNSCANNED for f in report.findings)


def _verdict(report, tmp_path) -> str:
    return report.save(tmp_path / "report.txt").read_text().splitlines()[0]


def test_branch_that_overflows_not_taken_gives_a_clean_verdict(tmp_path):
    report = fp16lens.scan(gate(), [_feed(X, False)], progress=False)
    out16, first = _truth(gate(flat=False), _feed(X, False), tmp_path)
    assert first is None and np.isfinite(out16).all()
    assert report.clean and not report.spans
    assert "gate/else/half" in report.sites and "gate/then/amp" not in report.sites
    assert "gate (else, 1 batch)" in _inlined_note(report)
    assert "is FP16-safe" in _verdict(report, tmp_path)


def test_nested_ifs_are_inlined_down_to_the_branch_taken(tmp_path):
    feed = _feed(X, True)
    report = fp16lens.scan(nested(), [feed], progress=False)
    out16, first = _truth(nested(flat=True), feed, tmp_path)
    assert not np.isfinite(out16).all() and np.isfinite(_fp32(nested(), feed)).all()
    assert report.spans[0].start == first == "route/then/inner/then/amp"
    note = _inlined_note(report)
    assert "route (then, 1 batch)" in note and "route/then/inner (then, 1 batch)" in note
    # small values: the inner test (max(h) > 10) takes the else branch, which is clean
    small = fp16lens.scan(nested(), [_feed(SMALL, True)], progress=False)
    assert small.clean and "route/then/inner/else/pass" in small.sites
    assert _truth(nested(flat=False), _feed(SMALL, True), tmp_path)[1] is None


def test_condition_changing_between_batches_builds_one_graph_per_path(monkeypatch):
    built = []
    analyse = _variants.analyse
    monkeypatch.setattr(_variants, "analyse", lambda m: built.append(m) or analyse(m))
    batches = [_feed(X, True), _feed(X, False), _feed(SMALL, True), _feed(X, False)]
    report = fp16lens.scan(gate(), batches, progress=False)
    assert len(built) == 2  # then and else, each built once
    assert {"gate/then/amp", "gate/else/half"} <= set(report.sites)
    [span] = report.spans
    assert span.start == "gate/then/amp" and span.batches == 1
    assert report.sites["gate/then/amp"].calls == 2 and report.sites["gate/else/half"].calls == 2
    note = _inlined_note(report)
    assert "gate (then, 2 batches)" in note and "gate (else, 2 batches)" in note


def _with_loop(model):
    """``model`` with a Loop (one iteration, y x 2, ``gain`` read from outside) after it."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["c_in"], ["c_out"]),
            helper.make_node("Mul", ["v_in", "gain"], ["v_out"], name="twice"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
            _vi("v_in"),
        ],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), _vi("v_out")],
    )
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.initializer.append(numpy_helper.from_array(np.array(1, np.int64), "trips"))
    m.graph.node.append(
        helper.make_node("Loop", ["trips", "", "y"], ["z"], name="repeat", body=body)
    )
    m.graph.output[0].name = "z"
    return m


def test_loop_bodies_stay_unscanned_and_only_they_are_named(tmp_path):
    report = fp16lens.scan(_with_loop(gate()), [_feed(SMALL, False)], progress=False)
    [unseen] = [f for f in report.findings if f.kind == FindingKind.UNSCANNED]
    assert "repeat (Loop)" in unseen.detail and "gate" not in unseen.detail
    assert "backend='onnx-fp16'" in suggest_fix(report, unseen)
    assert "gate (else, 1 batch)" in _inlined_note(report) and "gate/else/half" in report.sites
    verdict = _verdict(report, tmp_path)
    assert "FP16-safe" not in verdict and "not every value" in verdict


def test_patch_refuses_spans_inside_an_inlined_branch():
    model = gate()
    report = fp16lens.scan(model, [_feed(X, True)], progress=False)
    before = model.SerializeToString()
    with pytest.raises(PatchError, match=r"gate/then/amp lie inside the If 'gate'"):
        fp16lens.patch(model, report)
    assert model.SerializeToString() == before


@pytest.mark.parametrize("lift", ["down", "relu"])
def test_patch_fixes_a_main_graph_span_before_an_if(lift, tmp_path):
    """The If's inlined sites fold back into the If node: the span before it is patched,
    and real FP16 storage of the patched graph keeps FP32's output. ``relu``: the region
    ends at the If, an FP32 island whose branch reads the Relu's output multiplied back."""
    model, feed = gate(lift=lift), _feed(X, False)
    report = fp16lens.scan(model, [feed], progress=False)
    out16, first = _truth(model, feed, tmp_path)
    assert report.spans[0].start == first == "up"
    assert np.isfinite(out16).all() == (lift == "relu")  # Relu turns -inf into 0
    patched = fp16lens.patch(model, report)
    fixed16, first = _truth(patched, feed, tmp_path)
    assert first is None and np.allclose(fixed16, _fp32(model, feed), rtol=1e-3)
    assert [n.op_type for n in patched.graph.node].count("If") == 1
    if lift == "relu":  # the branch reads h multiplied back by the region's factor
        meta = {p.key: p.value for p in patched.metadata_props}
        assert "gate" in json.loads(meta["fp16lens.fp32_nodes"])
        [mul] = [n for n in patched.graph.node if n.op_type == "Mul" and n.input[0] == "h"]
        [branch] = [
            a.g
            for n in patched.graph.node
            if n.op_type == "If"
            for a in n.attribute
            if a.name == "else_branch"
        ]
        assert branch.node[0].input[0] == mul.output[0]


def test_a_computed_condition_is_checked_in_the_scans_own_run(monkeypatch):
    """A batch first runs on the graph of the batch before, whose run computes the inner
    If's condition (max(h) > 10): the conditions are learnt apart only when the path
    changes, and a batch on another path is scanned on its own graph."""
    from fp16lens.watch.onnx._paths import Inliner

    resolved = []
    resolve = Inliner.resolve
    monkeypatch.setattr(
        Inliner, "resolve", lambda self, feed: resolved.append(1) or resolve(self, feed)
    )
    batches = [_feed(X, True), _feed(X, True), _feed(SMALL, True), _feed(X, True)]
    report = fp16lens.scan(nested(), batches, progress=False)
    assert len(resolved) == 3  # the first batch, and the two changes of path
    [span] = report.spans
    assert span.start == "route/then/inner/then/amp" and span.batches == 3
    assert report.sites["route/then/inner/else/pass"].calls == 1
    resolved.clear()
    assert fp16lens.scan(nested(), batches[:2] * 5, progress=False).spans[0].batches == 10
    assert len(resolved) == 1


def test_a_branch_value_named_like_an_outer_one_is_renamed_when_inlined():
    """ONNX Runtime lets a branch reuse an outer name (here the graph output ``y``): the
    inlined copy renames the branch's own value, so the scan sees the same span."""
    model = gate()
    [branch] = [a.g for a in model.graph.node[1].attribute if a.name == "then_branch"]
    for n in branch.node:
        n.input[:] = ["y" if t == "t_big" else t for t in n.input]
        n.output[:] = ["y" if t == "t_big" else t for t in n.output]
    feed = _feed(X, True)
    assert np.array_equal(_fp32(model, feed), _fp32(gate(), feed))
    report = fp16lens.scan(model, [feed], progress=False)
    [span] = report.spans
    assert (span.start, span.end, span.peak) == ("gate/then/amp", "gate/then/shrink", 102400)
    assert report.sites["post"].absmax == 200
