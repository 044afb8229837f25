"""INT8 scale migration (``export/_int8_equalize``) on trained weights: each quantized
input's per-channel scale moves into the affine op before it (batch norm, PaddlePaddle's
learnable affine blocks, a LayerNorm's gamma/beta) and its weights take the inverse.

Ground truth is the FP32 graph in ONNX Runtime: the rewrite must not change it beyond FP32
rounding, on inputs the ranges were not taken from, and must lower the all-INT8 error.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import int8_zoo  # noqa: E402


@pytest.mark.parametrize("name", ["detector", "recognizer"])
def test_equalization_is_exact_in_fp32(name, int8_prepared):
    from fp16lens.export import _int8_equalize as eq

    case, proto, units = int8_prepared(name)
    before = proto.SerializeToString()
    moved, pairs, change = eq.equalize(proto, units, case.cal)
    assert proto.SerializeToString() == before  # the user's graph is not touched
    assert len(pairs) >= 20 and moved is not proto
    kinds = {(moved_op(moved, p), p.depthwise) for p in pairs}
    assert ("BatchNormalization", True) in kinds and ("Add", False) in kinds, kinds
    if name == "recognizer":  # a LayerNorm's gamma/beta before a MatMul
        assert any(p.axis == -1 for p in pairs)
    # every moved input changed: channels rescaled, not a no-op
    consts = {i.name: i for i in moved.graph.initializer}
    assert all(f"{p.weight}__eq" in consts for p in pairs)
    ref = int8_zoo.run_outputs(proto, case.eval)  # inputs the ranges were not taken from
    got = int8_zoo.run_outputs(moved, case.eval)
    assert eq.relative_error(ref, got) < 2e-6, eq.relative_error(ref, got)
    assert change < 2e-6


def moved_op(model, pair) -> str:
    return next(n.op_type for n in model.graph.node if n.name == pair.producer)


def test_equalization_lowers_the_detectors_int8_error(int8_prepared):
    """PP-OCRv4's detector: channels behind its first hardswishes span 0.5 to 105 (median
    6); moved into the affine blocks, the all-INT8 error at the output falls more than 3x."""
    from fp16lens.export._int8_search import Switch, _equalized, collect, nmse

    case, proto, units = int8_prepared("detector", n_cal=2, n_eval=1)
    graph, moved_units, pairs, note = _equalized(proto, units, case.cal, 1)
    assert pairs and "equalization kept" in note, note
    errors = []
    for g, us in ((proto, units), (graph, moved_units)):
        hists, _ = collect(g, us, case.eval)
        tensors = list(hists)
        scales = np.array([hists[t].amax / 127 for t in tensors])
        switch = Switch(g, us, tensors)
        ref = int8_zoo.run_outputs(proto, case.eval)  # the FP32 file
        errors.append(nmse(ref, switch.run(case.eval, np.ones(len(us)), scales)))
    assert errors[1] < errors[0] / 3, errors


def test_centring_is_exact_and_with_bias_correction_lowers_the_detectors_int8_error(int8_prepared):
    """PP-OCRv4's detector: the 1x1 convs after its hardswish + affine blocks read channels
    from about -0.4 to 29. Shifted per channel to the middle of their range (the shift in the
    conv's bias), the FP32 output is unchanged to FP32 rounding on other inputs and every
    centred input's per-tensor range shrinks. The hardswish's zeros now sit off the INT8 grid
    (a constant rounding error per channel), so centring pays only with the bias correction
    that takes it off: p2o.Conv.2 alone in INT8 (max ranges, bias corrected on the
    calibration items) then costs less at the output on other inputs; without it, more."""
    from fp16lens.export import _int8_equalize as eq
    from fp16lens.export._int8_search import Switch, bias_corrections, collect, nmse

    case, proto, units = int8_prepared("detector", n_cal=2, n_eval=2)
    before = proto.SerializeToString()
    centred, shifts, change = eq.centre(proto, units, case.cal)
    assert proto.SerializeToString() == before  # the user's graph is not touched
    readers = {s.reader for s in shifts}
    assert len(shifts) >= 10 and {"p2o.Conv.2", "p2o.Conv.6"} <= readers, readers
    ref = int8_zoo.run_outputs(proto, case.eval)  # the FP32 file, inputs not calibrated on
    assert eq.relative_error(ref, int8_zoo.run_outputs(centred, case.eval)) < eq.EXACT
    assert change < eq.EXACT
    plain, corrected, amaxes = [], [], []
    on = np.array([u.node == "p2o.Conv.2" for u in units], float)
    for g in (proto, centred):
        hists, _ = collect(g, units, case.cal)
        tensors = list(hists)
        scales = np.array([hists[t].amax / 127 for t in tensors])
        amaxes.append({t: hists[t].amax for t in tensors})
        plain.append(nmse(ref, Switch(g, units, tensors).run(case.eval, on, scales)))
        fix = bias_corrections(g, units, tensors, scales, case.cal)
        switch = Switch(g, units, tensors, {"p2o.Conv.2": fix["p2o.Conv.2"]})
        corrected.append(nmse(ref, switch.run(case.eval, on, scales)))
    assert all(amaxes[1][s.tensor] < 0.75 * amaxes[0][s.tensor] for s in shifts), amaxes
    # the TensorRT 10 cache serves the FP32 graph: it takes each tensor's uncentred range
    assert all(s.amax == pytest.approx(amaxes[0][s.tensor], rel=1e-6) for s in shifts)
    assert plain[1] > plain[0], plain  # the off-grid zeros: why centring needs the correction
    assert corrected[1] < corrected[0] / 2, corrected


def test_a_layernorm_node_takes_the_scale_as_its_decomposed_form(int8_prepared):
    """PP-OCRv4's recognizer with its SVTR LayerNorms as LayerNormalization nodes (the form
    PyTorch's exporter writes at opset 17; paddle2onnx writes nine ops): the same norms move
    their scale into the same MatMuls as in the decomposed graph, exactly in FP32 on inputs
    the ranges were not taken from, and the search keeps it for the same drop in the
    all-INT8 error."""
    from fp16lens.export import _int8_equalize as eq
    from fp16lens.export._int8_place import find_units
    from fp16lens.export._int8_search import _equalized, _int8_errors

    case, proto, units = int8_prepared("recognizer", n_cal=2, n_eval=2)
    fused = int8_zoo.fused_layernorms(proto)
    assert sum(n.op_type == "LayerNormalization" for n in fused.graph.node) == 5
    fused_units = find_units(fused.graph, set())
    by_norm = {
        p.reader
        for p in eq.find_pairs(fused.graph, fused_units)
        if moved_op(fused, p) == "LayerNormalization"
    }
    decomposed = {p.reader for p in eq.find_pairs(proto.graph, units) if p.axis == -1}
    assert by_norm == decomposed == {"p2o.MatMul.8", "p2o.MatMul.20"}, (by_norm, decomposed)
    ref = int8_zoo.run_outputs(proto, case.eval)
    errors = {}
    for label, (graph, us) in {"decomposed": (proto, units), "fused": (fused, fused_units)}.items():
        moved, moved_units, pairs, note = _equalized(graph, us, case.cal, 1)
        assert "equalization kept" in note and decomposed <= {p.reader for p in pairs}, note
        assert eq.relative_error(ref, int8_zoo.run_outputs(moved, case.eval)) < 2e-6
        # all in INT8 at max ranges, on the probe line the move was decided on
        probe = case.cal[:1]
        errors[label] = tuple(_int8_errors(((graph, us), (moved, moved_units)), probe, {}))
    assert errors["fused"][1] < errors["fused"][0] / 2, errors
    assert errors["fused"] == pytest.approx(errors["decomposed"], rel=0.05), errors


def _migrated(model, shape: tuple[int, ...], tmp_path, dynamo: bool = False):
    """``model`` exported (opset 18: LayerNormalization one node) and its scale migration on two random batches: (the
    pairs moved, the FP32 change on a third batch, the all-INT8 output error there at max
    ranges before and after)."""
    import torch

    from fp16lens.export import _int8_equalize as eq
    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import find_units, name_nodes
    from fp16lens.export._int8_search import Switch, collect, nmse

    torch.onnx.export(
        model, (torch.randn(shape),), tmp_path / "m.onnx", dynamo=dynamo, opset_version=18
    )
    proto = prepared(onnx.load(tmp_path / "m.onnx"))
    name_nodes(proto.graph)
    units = find_units(proto.graph, set())
    feeds = [{proto.graph.input[0].name: torch.randn(shape).numpy()} for _ in range(3)]
    moved, pairs, _ = eq.equalize(proto, units, feeds[:2])
    ref = int8_zoo.run_outputs(proto, feeds[2:])
    change = eq.relative_error(ref, int8_zoo.run_outputs(moved, feeds[2:]))
    nodes = {n.name: n for n in moved.graph.node}
    movers = [
        dataclasses.replace(u, weight=nodes[u.node].input[1]) if u.weight else u for u in units
    ]
    errors = []
    for graph, us in ((proto, units), (moved, movers)):
        hists, _ = collect(graph, us, feeds[:2])
        tensors = list(hists)
        scales = np.array([hists[t].amax / 127 for t in tensors])
        errors.append(
            nmse(ref, Switch(graph, us, tensors).run(feeds[2:], np.ones(len(us)), scales))
        )
    return [(moved_op(proto, p), p) for p in pairs], change, errors


def _outlier(norm, *readers) -> None:
    """One channel's gamma 100 times the rest, read by weights 100 times smaller: the
    outlier features trained transformers grow."""
    import torch

    with torch.no_grad():
        norm.weight[3] = 100.0
        norm.bias.normal_()
        for weight in readers:
            weight[:, 3] /= 100


def test_a_layernorm_before_a_gemm_moves_its_scale(tmp_path):
    """A LayerNorm over the last axis before nn.Linear on 2-D tokens (exported as Gemm,
    transB=1): its gamma and beta take the division, the Gemm's weight columns the product;
    exact in FP32, and with an outlier channel the all-INT8 error at max ranges falls."""
    from torch import nn

    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 8)).eval()
    _outlier(model[0], model[1].weight)
    pairs, change, errors = _migrated(model, (16, 32), tmp_path)
    assert [(op, p.weight_axis, p.more) for op, p in pairs] == [("LayerNormalization", 1, ())]
    assert change < 2e-6
    assert errors[1] < errors[0] / 4, errors


def test_a_layernorm_before_separate_query_key_value_moves_its_scale_into_all(tmp_path):
    """A pre-norm attention block with separate query, key and value Linears (as Hugging
    Face's ViT writes it): the norm is read by three MatMuls, one division serves all three
    and each weight takes the product: one pair, exact in FP32, the error falls. With the
    norm's output read by a residual Add too (a post-norm block), nothing moves."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, residual: bool):
            super().__init__()
            self.norm = nn.LayerNorm(32)
            self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
            self.residual = residual

        def forward(self, x):
            h = self.norm(x)
            a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / 32**0.5, dim=-1)
            return a @ self.v(h) + (h if self.residual else 0)

    model = Attention(residual=False).eval()
    _outlier(model.norm, model.q.weight, model.k.weight, model.v.weight)
    pairs, change, errors = _migrated(model, (1, 16, 32), tmp_path)
    assert [(op, len(p.more)) for op, p in pairs] == [("LayerNormalization", 2)], pairs
    assert change < 2e-6
    assert errors[1] < errors[0] / 4, errors
    post = Attention(residual=True).eval()
    assert _migrated(post, (1, 16, 32), tmp_path)[0] == []


def test_a_pre_norm_encoder_layer_moves_both_norms(tmp_path):
    """torch's nn.TransformerEncoderLayer (norm_first, batch_first), as torch's own
    exporter writes it: the first norm reaches the packed QKV projection through a
    Transpose that keeps the channels last, the second reads the MLP's first Linear; both
    move, exact in FP32, and with outlier channels the all-INT8 error falls."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
    layer.eval()
    _outlier(layer.norm1, layer.self_attn.in_proj_weight)
    _outlier(layer.norm2, layer.linear1.weight)
    try:
        pairs, change, errors = _migrated(layer, (1, 16, 32), tmp_path, dynamo=True)
    except torch.onnx.OnnxExporterError as exc:  # torch 2.4's dynamo exporter; TorchScript
        # traces the layer's is_causal as a tensor on every release
        pytest.skip(f"torch {torch.__version__} does not export the layer: {exc}")
    assert [op for op, _ in pairs] == ["LayerNormalization"] * 2, pairs
    assert change < 2e-6
    assert errors[1] < errors[0] / 4, errors


def test_equalization_of_a_conv1d_pair_broadcasts_over_its_one_spatial_axis(tmp_path):
    """Silero VAD (the wheel's 16 kHz file) patched for raw int16 samples: the STFT's
    magnitude leaves its FP32 island through a Mul by 2^-6 into the first encoder Conv1d,
    a pair whose scale moves into that Mul's constant. Its tensor is (N, C, T): the moved
    constant is (C, 1), not a Conv2d's (C, 1, 1), which broadcast the batch axis to C and
    broke the LSTM behind it. Exact in FP32 on another speaker's chunks (ONNX Runtime on
    the patched file as written)."""
    import zoo_real as z

    import fp16lens
    from fp16lens.export import _int8_equalize as eq
    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import find_units, name_nodes

    try:
        path = z.silero_onnx()
    except z.Missing as exc:
        pytest.skip(str(exc))

    cal, held = z.vad_chunks(z.SPEECH_WAV, 16), z.vad_chunks(z.SPEECH2_WAV, 8)
    report = fp16lens.scan(path, cal, progress=False)
    fp16lens.patch(path, report, batches=cal, out=tmp_path / "patched.onnx")
    proto = prepared(onnx.load(tmp_path / "patched.onnx"))
    name_nodes(proto.graph)
    moved, pairs, change = eq.equalize(proto, find_units(proto.graph, set()), cal)
    into_mul = [p for p in pairs if moved_op(moved, p) == "Mul"]
    assert into_mul and moved is not proto, pairs
    shapes = {
        tuple(i.dims)
        for i in moved.graph.initializer
        if i.name.endswith(f"__eq_{into_mul[0].reader}")
    }
    assert shapes and all(len(s) == 2 and s[1] == 1 for s in shapes), shapes
    ref = int8_zoo.run_outputs(proto, held)
    got = int8_zoo.run_outputs(moved, held)
    assert eq.relative_error(ref, got) < 2e-6 and change < 2e-6
