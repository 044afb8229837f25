"""INT8 scale migration (``export/_int8_equalize``) on trained weights: each quantized
input's per-channel scale moves into the affine op before it (batch norm, PaddlePaddle's
learnable affine blocks, a LayerNorm's gamma/beta) and its weights take the inverse.

Ground truth is the FP32 graph in ONNX Runtime: the rewrite must not change it beyond FP32
rounding, on inputs the ranges were not taken from, and must lower the all-INT8 error.
"""

from __future__ import annotations

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
