"""An input on an 8-bit grid encoded in INT8 exactly (``export/_int8_grid``), on trained
weights: images normalized per channel reach the first conv as the INT8 codes themselves.

Ground truth is the FP32 graph in ONNX Runtime: the rewrite must not change it beyond FP32
rounding on inputs the grid was not taken from, the encoded input must be integers in
[-128, 127] there, and the first conv alone in INT8 must cost less at the output.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import int8_zoo  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1)
STD = np.array([0.229, 0.224, 0.225]).reshape(1, 3, 1, 1)


def test_a_grid_is_found_in_normalized_pixels_and_nowhere_else():
    from fp16lens.export._int8_grid import channel_grid

    rng = np.random.default_rng(0)
    pixels = rng.integers(3, 251, (1, 3, 48, 48)).astype(np.float64)
    x = ((pixels / 255 - MEAN) / STD).astype(np.float32)  # as PP-OCR and torchvision feed it
    for c in range(3):
        step, offset = channel_grid(x[0, c])
        assert step == pytest.approx(1 / 255 / STD.ravel()[c], rel=1e-6)
        codes = x[0, c] / step + offset
        assert np.abs(codes - np.rint(codes)).max() < 1e-3  # on the codes
        assert codes.min() >= -128 and codes.max() <= 127
        assert codes.max() - codes.min() == pytest.approx(247, abs=1e-3)  # 3..250 seen
        # the value 0 in the middle, as symmetric INT8 has it, or moved just enough to fit
        assert abs(offset + 0.5) <= 0.5 or round(codes.max()) == 127 or round(codes.min()) == -128
    full = np.arange(256.0).repeat(8)  # MTCNN's (p - 127.5) / 128: every level, p - 128
    step, offset = channel_grid(((full - 127.5) / 128).astype(np.float32))
    assert (step, offset) == (1 / 128, -0.5)
    light = (np.arange(100.0, 256.0).repeat(8) / 255 - 0.485) / 0.229  # 0 is at p = 123.7
    step, offset = channel_grid(light.astype(np.float32))
    assert round(light.max() / step + offset) == 127  # p = 255 would be 131: moved to fit
    assert channel_grid(rng.standard_normal(4096).astype(np.float32)) is None  # features
    samples = rng.integers(-32768, 32767, 8192) / 32768  # 16-bit audio: more than 256 levels
    assert channel_grid(samples.astype(np.float32)) is None
    assert channel_grid(x[0, 0, :10, :10]) is None  # too few values to show a grid
    skewed = np.concatenate([x[0, 0].ravel(), [x[0, 0].max() + 0.5 * step]])
    assert channel_grid(skewed) is None  # one value off the grid


def test_grid_encoding_is_exact_and_puts_the_detectors_pixels_on_the_int8_codes(int8_prepared):
    """PP-OCRv4's detector reads ImageNet-normalized pixels through a padded stride-2 conv:
    the pixels become codes, the conv's zeros come from a Pad before them, and FP32 does
    not move; the stem alone in INT8 then costs the output over 20x less."""
    from fp16lens.export import _int8_grid as grid
    from fp16lens.export._int8_equalize import relative_error
    from fp16lens.export._int8_place import find_units
    from fp16lens.export._int8_search import _exposed, _int8_errors, _run_all, session

    case, proto, units = int8_prepared("detector", 2, 2)
    before = proto.SerializeToString()
    moved, grids, change = grid.encode(proto, units, case.cal)
    assert proto.SerializeToString() == before  # the user's graph is not touched
    assert [g.reader for g in grids] == ["p2o.Conv.0"] and change < 2e-6
    stem = next(n for n in moved.graph.node if n.name == "p2o.Conv.0")
    assert not any(next(a.ints for a in stem.attribute if a.name == "pads"))
    assert [n.op_type for n in moved.graph.node[:3]] == ["Pad", "Mul", "Add"]
    ref = int8_zoo.run_outputs(proto, case.eval)  # images the grid was not taken from
    assert relative_error(ref, int8_zoo.run_outputs(moved, case.eval)) < 2e-6
    sess = session(_exposed(moved, [grids[0].tensor]))
    for feed in [*case.cal, *case.eval]:
        codes = _run_all(sess, feed, [grids[0].tensor])[grids[0].tensor][:, :, 1:-1, 1:-1]
        assert np.abs(codes - np.rint(codes)).max() < 1e-3  # the border aside: the pad's zeros
    for feed in case.cal:  # the range seen fits the codes (an unseen darker pixel clips)
        codes = _run_all(sess, feed, [grids[0].tensor])[grids[0].tensor]
        assert codes.min() >= -128.5 and codes.max() <= 127.5
    errors = _int8_errors(
        ((proto, units), (moved, find_units(moved.graph, set()))),
        case.cal,
        {grids[0].tensor: 1.0},
        {"p2o.Conv.0"},
    )
    assert errors[1] < errors[0] / 20, errors


def test_a_feature_input_is_left_as_it_is(int8_prepared):
    """CREPE reads audio frames divided by their std: no grid, nothing rewritten."""
    from fp16lens.export import _int8_grid as grid

    case, proto, units = int8_prepared("crepe", 2, 1)
    moved, grids, change = grid.encode(proto, units, case.cal)
    assert moved is proto and grids == [] and change == 0.0


def test_the_plan_writes_scale_one_and_the_cache_keeps_the_inputs_range(tmp_path, int8_prepared):
    """MTCNN PNet through ``export``: the Q/DQ file quantizes the encoded pixels with scale 1,
    the face cells hold better than without the encoding on the held-out items, and the
    TensorRT 10 cache gives the FP32 graph's input its own range."""
    from fp16lens.export import export, read_calibration_cache
    from fp16lens.export._int8_search import searcher, write_qdq

    case, proto, _ = int8_prepared("pnet", 8, 24)
    out = tmp_path / "pnet_int8.onnx"
    art = export(case.path, None, str(out), "int8", calibration=list(case.cal))
    written = onnx.load(str(out))
    q = next(n for n in written.graph.node if n.op_type == "QuantizeLinear")
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in written.graph.initializer}
    assert "__grid_" in q.input[0] and float(inits[q.input[1]]) == 1.0
    assert any("grid encoding kept" in w for w in art.warnings), art.warnings
    name = written.graph.input[0].name
    amax = max(float(np.abs(f[name]).max()) for f in case.cal)
    cache = read_calibration_cache(art.calibration_cache)
    assert cache[name] == pytest.approx(amax / 127, rel=1e-6)
    # the cache cannot carry what the search rewrote: export says so, naming the cache
    (said,) = [w for w in art.warnings if "calibration cache" in w]
    assert "pnet_int8.cache" in said and "Q/DQ file" in said, said
    assert "the input's encoding on the INT8 codes before 1 layer " in said, said
    refs = int8_zoo.run_outputs(case.path, case.eval)
    with_grid = case.metric(refs, int8_zoo.run_outputs(written, case.eval))
    plain = searcher(proto, list(case.cal), encode=False)
    without = case.metric(refs, int8_zoo.run_outputs(write_qdq(proto, plain.plan), case.eval))
    key = "face cell IoU"
    assert with_grid[key] > without[key] + 0.02, (with_grid, without)
