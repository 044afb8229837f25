"""FP32 islands that really fix their span (patch/_reach.py): an island reaches the op
where values are back in range, neighbouring islands pass FP32 to each other, a region
between islands does not flush what a log reads, a span that reaches the model output
stays FP32 there, and watch judges an island's output as the FP16 tensor it becomes.

Ground truth: real FP16 on the CPU (``copy.deepcopy(m).half()(x.half())``); for an ONNX
graph, ONNX Runtime with every float output of a node outside the islands stored through
a Cast to FP16 and back (built here, without fp16lens).
"""

from __future__ import annotations

import copy
import io
import json
import warnings

import pytest
import torch
import zoo_real

import fp16lens
from fp16lens._core.algebra import rescale_exponent
from fp16lens._core.compat import TORCH_VERSION
from fp16lens.patch import Fp32Island, get_plan, patch, relative_error
from fp16lens.patch._options import PatchOptions

from models import (
    embedding_output,
    exp_log,
    hardswish_stem,
    lstm_raw_input,
    raw_conv_input,
    relu_span,
    silu_pair,
    stft_log,
)
from torchvision_compat import need_torchvision

FP32_TOL = 1e-4


def _report(model, inputs):
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(*inputs)
    return lens.report


@torch.no_grad()
def _half(model, inputs):
    args = tuple(a.half() if a.is_floating_point() else a for a in inputs)
    return copy.deepcopy(model).half()(*args)


def _onnx(model, inputs):
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, buf, opset_version=17, dynamo=False, input_names=["x"])
    return buf.getvalue()


def _onnx2torch(model, inputs):
    need_torchvision()  # onnx2torch imports torchvision
    onnx2torch = pytest.importorskip("onnx2torch")
    onnx = pytest.importorskip("onnx")
    return onnx2torch.convert(onnx.load_from_string(_onnx(model, inputs))).eval()


@torch.no_grad()
def _proven(model, patched, inputs, tol: float = 2e-3):
    """FP32 outputs unchanged, real FP16 of the patched model finite and near FP32."""
    want = model(*inputs)
    assert relative_error(want, patched(*inputs)) <= FP32_TOL
    half = _half(patched, inputs)
    assert torch.isfinite(half).all()
    assert relative_error(want, half.float()) < tol


def test_an_island_reaches_the_div_that_brings_hardswish_back_in_range():
    """onnx2torch's hardswish: Mul (peak 8e4) then Div by 6. An island on the Mul alone
    hands 8e4 back to FP16 (inf); the island reaches the Div, the Mul handing it FP32."""
    model, inputs = hardswish_stem()
    g = _onnx2torch(model, inputs)
    assert not torch.isfinite(_half(g, inputs)).all()  # the case is real
    patched = patch(g, _report(g, inputs))
    islands = {i.module: i for i in get_plan(patched).islands}
    assert set(islands) == {"Mul", "Div"}
    assert islands["Mul"].fp32_out and islands["Div"].fp32_in and not islands["Div"].fp32_out
    assert not get_plan(patched).unresolved
    _proven(g, patched, inputs)


@pytest.mark.skipif(
    TORCH_VERSION < (2, 5),
    reason="islands of the model's own ops map watched sites to fx nodes by op name; torch 2.4 "
    "names them otherwise (relu6 is hardtanh, / 6 a truediv), so they stay unresolved there",
)
def test_ops_of_the_models_own_forward_become_one_island_that_reaches_the_div():
    """The same hardswish written in the model's forward: no module runs it, so its ops
    (x + 3, relu6, the product, / 6) move into one new child island, fed the conv's output
    and handing back the / 6 in range; it exports with only those nodes in FP32."""
    model, inputs = hardswish_stem()
    assert not torch.isfinite(_half(model, inputs)).all()
    patched = patch(model, _report(model, inputs))
    the_plan = get_plan(patched)
    assert not the_plan.unresolved and len(the_plan.islands) == 1
    assert the_plan.islands[0].nodes == ("add", "relu6", "mul", "truediv")
    assert isinstance(patched.get_submodule(the_plan.islands[0].module), Fp32Island)
    _proven(model, patched, inputs)
    assert _report(patched, inputs).clean


def test_islands_next_to_each_other_pass_fp32_between_them():
    """exp (1.6e5) then log: two ops no scale passes, each its own island; the value
    between them stays FP32 instead of going through FP16 as inf."""
    model, inputs = exp_log()
    assert not torch.isfinite(_half(model, inputs)).all()
    patched = patch(model, _report(model, inputs))
    islands = {i.module: i for i in get_plan(patched).islands}
    assert set(islands) == {"exp", "log"} and islands["exp"].fp32_out and islands["log"].fp32_in
    assert patched.exp.fp32_out and patched.log.fp32_in  # what the modules do
    _proven(model, patched, inputs)
    assert fp16lens.verify(
        model, patched, [inputs], backend="torch-emulated"
    )  # its emulation agrees


def test_stft_magnitude_of_raw_int16_samples_stays_fp32_up_to_the_log():
    """conv -> square -> add -> sqrt -> log on raw int16 samples: no region reaches past
    the log; the magnitude and the log run in FP32, handing FP32 from one to the other."""
    model, inputs = stft_log()
    assert not torch.isfinite(_half(model, inputs)).all()
    patched = patch(model, _report(model, inputs))
    the_plan = get_plan(patched)
    assert not the_plan.unresolved and set(the_plan.fp32_modules) == {"log", "stft"}
    _proven(model, patched, inputs)


def _onnx_half(proto, feed: dict, fp32_nodes: set[str]):
    """The graph in ONNX Runtime with every float output of a node outside ``fp32_nodes``
    stored in FP16 (a Cast to FP16 and back), optimizations off."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    m = copy.deepcopy(proto)
    inferred = onnx.shape_inference.infer_shapes(m).graph
    floats = {
        v.name
        for v in (*inferred.value_info, *inferred.output)
        if v.type.tensor_type.elem_type == 1
    }
    nodes = []
    for node in m.graph.node:
        nodes.append(node)
        if node.name in fp32_nodes:
            continue
        for i, out in enumerate(node.output):
            if out in floats:
                node.output[i] = f"{out}__raw"
                nodes.append(helper.make_node("Cast", [f"{out}__raw"], [f"{out}__h"], to=10))
                nodes.append(helper.make_node("Cast", [f"{out}__h"], [out], to=1))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, feed
    )[0]


def test_onnx_spectrogram_region_between_islands_does_not_flush_before_the_log():
    """The same front end as an ONNX graph: every node is its own island, so regions sit
    between them. Scaled by 2^20 the squares of near-silent frames go below FP16's normal
    range before Sqrt and Log (30% off); those regions merge with the islands."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    model, inputs = stft_log()
    proto = onnx.load_from_string(_onnx(model, inputs))
    feed = {"x": inputs[0].numpy()}
    report = fp16lens.scan(proto, [feed], progress=False)
    patched = fp16lens.patch(proto, report)
    meta = {p.key: p.value for p in patched.metadata_props}
    fp32_nodes = set(json.loads(meta["fp16lens.fp32_nodes"]))
    assert {"/stft/Pow", "/stft/Pow_1", "/stft/Add", "/stft/Sqrt", "/log/Log"} <= fp32_nodes
    regions = fp16lens.patch.plan(proto, report).regions
    assert not any("/stft/Add" in r.sites for r in regions)  # the squares are not scaled in FP16
    want = model(*inputs).detach().numpy()
    got = _onnx_half(patched, feed, fp32_nodes)
    assert abs(got - want).max() / abs(want).max() < 2e-3


def test_a_span_reaching_the_model_output_stays_fp32_there(tmp_path):
    """An embedding row beyond 65504, then the Linear that is the output: the Linear is an
    FP32 island fed the embedding's region scale, and its output stays FP32 under
    ``.half()`` and in the FP16 export (io_dtype='fp16' too)."""
    model, inputs = embedding_output()
    assert not torch.isfinite(_half(model, inputs)).all()
    patched = patch(model, _report(model, inputs))
    the_plan = get_plan(patched)
    assert not the_plan.unresolved and [i.module for i in the_plan.islands] == ["fc"]
    assert the_plan.islands[0].fp32_out
    assert _half(patched, inputs).dtype == torch.float32
    _proven(model, patched, inputs, tol=1e-6)
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "m.onnx"
    fp16lens.export(patched, inputs, path, precision="fp16", io_dtype="fp16")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: inputs[0].numpy()}
    (out,) = zoo_real.onnx_fp16_file_real(str(path), feed).values()  # FP16 storage real
    want = model(*inputs).detach().numpy()
    assert out.dtype.name == "float32" and abs(out - want).max() / abs(want).max() < 1e-5


def test_watch_judges_an_island_output_as_the_fp16_tensor_it_becomes():
    """An island on the Mul alone (what patch used to do) hands 8e4 back: watch says so
    (a span, not FP16-safe), as real FP16 does; the island that reaches the Div is clean."""
    model, inputs = hardswish_stem()
    g = _onnx2torch(model, inputs)
    early = copy.deepcopy(g)
    early.Mul = Fp32Island(early.Mul)
    report = _report(early, inputs)
    assert not report.clean and report.spans
    assert not torch.isfinite(_half(early, inputs)).all()
    fixed = patch(g, _report(g, inputs))
    assert _report(fixed, inputs).clean
    assert torch.isfinite(_half(fixed, inputs)).all()


def test_replan_keeps_a_span_fp32_end_to_end_and_merges_islands():
    """The seam of the widening loop: a span rescaled by default is kept FP32 end to end
    when asked (no region; every site of it in an island), and merging two islands keeps
    the values between them FP32."""
    from fp16lens.patch._planner import replan

    model, inputs = relu_span()
    report = _report(model, inputs)
    opts = PatchOptions()
    default = replan(model, report, opts)
    assert default.regions and not default.islands
    kept = replan(model, report, opts, fp32_spans=[0])
    assert not kept.regions and kept.islands and not kept.unresolved
    from fp16lens.patch._apply import apply_plan

    patched = apply_plan(copy.deepcopy(model), kept)
    _proven(model, patched, inputs)
    m2, in2 = silu_pair()
    r2 = _report(m2, in2)
    apart = {i.module: i for i in replan(m2, r2, opts).islands}
    assert set(apart) == {"1", "2"} and not apart["1"].fp32_out  # a region between them
    merged = replan(m2, r2, opts, merge=[["1", "2"]])
    islands = {i.module: i for i in merged.islands}
    assert islands["1"].fp32_out and islands["2"].fp32_in
    assert not any("1" in r.sites for r in merged.regions)
    _proven(m2, apply_plan(copy.deepcopy(m2), merged), in2)


@pytest.mark.parametrize("build", [lstm_raw_input, raw_conv_input], ids=["lstm", "conv"])
def test_an_input_beyond_fp16_is_folded_into_the_first_layer(build):
    """The caller divides the input by 2^k (the report's advice), the first layer holds
    2^k: FP32 outputs of the original on x and the patched on x / 2^k are equal, and
    real FP16 of the patched model on x / 2^k is finite and close."""
    model, inputs = build()
    assert not torch.isfinite(_half(model, inputs)).all()
    report = _report(model, inputs)
    patched = patch(model, report)
    the_plan = get_plan(patched)
    assert list(the_plan.input_scales) == [0] and not the_plan.unresolved
    k = rescale_exponent(max(f.peak for f in report.findings if f.site == "input[0]"))
    assert the_plan.input_scales[0] == 2.0**k
    assert [r.rule for r in the_plan.reparametrized] == ["input"]
    assert any("divided by" in n for n in the_plan.notes)
    scaled = the_plan.scale_inputs(*inputs)
    with torch.no_grad():
        want = model(*inputs)
        assert relative_error(want, patched(*scaled)) <= FP32_TOL
        half = _half(patched, scaled)
    assert torch.isfinite(half).all() and relative_error(want, half.float()) < 2e-3


def test_an_input_no_layer_can_hold_the_factor_is_said_unresolved():
    """x * 0.5 reads the input before the conv: the plan folds nothing and says why."""
    model, inputs = raw_conv_input(peak=1e5, scaled=True)  # x * 0.5 in range: only the input is
    the_plan = get_plan(patch(model, _report(model, inputs)))
    assert not the_plan.input_scales
    assert [u.site for u in the_plan.unresolved] == ["input[0]"]
    assert (
        ":mul" in the_plan.unresolved[0].reason and "divide it by" in the_plan.unresolved[0].reason
    )


def _ppocr_det_torch():
    """PP-OCRv4's text detector (rapidocr-onnxruntime's .onnx) converted with onnx2torch, and
    the word SHORT as raw 0-255 pixels; its Constant nodes become initializers first (the
    converter reads conv weights there)."""
    import zoo_real

    need_torchvision()
    onnx2torch = pytest.importorskip("onnx2torch")
    onnx = pytest.importorskip("onnx")
    try:
        path, x = zoo_real.ppocr_det(normalized=False)
    except zoo_real.Missing as exc:
        pytest.skip(str(exc))
    proto = onnx.load(path)
    nodes = []
    for n in proto.graph.node:
        if n.op_type == "Constant" and [a.name for a in n.attribute] == ["value"]:
            t = onnx.TensorProto()
            t.CopyFrom(n.attribute[0].t)
            t.name = n.output[0]
            proto.graph.initializer.append(t)
        else:
            nodes.append(n)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return onnx2torch.convert(proto).eval(), (torch.from_numpy(x),)


def test_real_text_detector_on_raw_pixels_is_finite_in_fp16_and_watch_agrees():
    """The case that was found: the stem's hardswish product peaks at 6.6e4 and returns at
    the / 6. The island reaches the Div; real FP16 of the patched model is finite (it was
    NaN), its probability map close to FP32, and watch on it agrees with real FP16."""
    model, inputs = _ppocr_det_torch()
    assert not torch.isfinite(_half(model, inputs)).all()
    patched = patch(model, _report(model, inputs))
    islands = {i.module: i for i in get_plan(patched).islands}
    assert islands["p2o/Mul/8"].fp32_out and islands["p2o/Div/1"].fp32_in
    with torch.no_grad():
        want = model(*inputs)
        assert relative_error(want, patched(*inputs)) <= FP32_TOL
    half = _half(patched, inputs).float()
    assert torch.isfinite(half).all()
    cos = torch.nn.functional.cosine_similarity(
        want.flatten().double(), half.flatten().double(), dim=0
    )
    assert cos > 0.999
    assert _report(patched, inputs).clean
