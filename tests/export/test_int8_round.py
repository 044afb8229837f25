"""Weight rounding fitted to the layer's inputs (``export/_int8_round``, GPTQ), on trained
weights.

Ground truth is the FP32 graph in ONNX Runtime on items the rounding was not fitted on:
the fitted codes must cost the output less than nearest rounding, stay on the nearest
rounding's scales, and be the codes the written Q/DQ file holds.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")

import int8_zoo  # noqa: E402


def test_fitted_rounding_costs_lite0_less_on_images_it_was_not_fitted_on(int8_prepared):
    """EfficientNet-Lite0 all in INT8 (max ranges): the codes fitted to 4 calibration crops
    cost its logits less than nearest rounding on 6 crops they were not fitted on; they
    sit on the nearest rounding's scales, fewer than 1% more than one step from it."""
    from fp16lens.export import _int8_round
    from fp16lens.export._int8_search import QMAX, Switch, collect, nmse, quantize_weight

    case, proto, units = int8_prepared("classifier", 4, 6)
    hists, _ = collect(proto, units, case.cal)
    tensors = list(hists)
    scales = np.array([hists[t].candidates()["max"] / QMAX for t in tensors])
    codes = _int8_round.fit(proto, units, case.cal, dict(zip(tensors, scales)))
    weighted = [u for u in units if u.weight is not None]
    assert len(codes) >= 10  # the convs whose fit held on the other half of the batches
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    moved = 0
    for u in weighted:
        if u.weight not in codes:
            continue
        nearest, _ = quantize_weight(inits[u.weight], u.axis)
        diff = codes[u.weight].astype(np.int32) - nearest
        assert codes[u.weight].dtype == np.int8 and codes[u.weight].shape == nearest.shape
        assert np.abs(diff).max() <= 16 and np.mean(np.abs(diff) > 1) < 0.01  # near the nearest
        moved += int(np.count_nonzero(diff))
    assert moved > 1000
    on, off = np.ones(len(units)), np.zeros(len(units))
    plain = Switch(proto, units, tensors)
    ref = plain.run(case.eval, off, scales)
    nearest_err = nmse(ref, plain.run(case.eval, on, scales))
    fitted_err = nmse(ref, Switch(proto, units, tensors, rounded=codes).run(case.eval, on, scales))
    assert fitted_err < 0.7 * nearest_err, (nearest_err, fitted_err)  # measured 0.032 -> 0.016


def test_the_fit_holds_one_pass_of_moments_at_a_time(int8_prepared, monkeypatch):
    """Trained MTCNN PNet with the moments' budget cut so that each layer takes a pass of
    its own: a pass's moments are freed before the next pass has made its own, and the
    codes are those one pass over every layer gives (PNet's patches are too few to be
    sampled, so the passes draw nothing at random). Holding every layer's moments until
    the end, the search of easyocr CRAFT at 96x320 peaked at 10.1 GB; one pass at a time,
    3.9 GB (``scripts/mem_int8_round.py``)."""
    import gc
    import weakref

    from fp16lens.export import _int8_round
    from fp16lens.export._int8_search import QMAX, collect

    case, proto, units = int8_prepared("pnet", 4, 1)
    hists, _ = collect(proto, units, case.cal)
    scales = {t: hists[t].candidates()["max"] / QMAX for t in hists}
    whole = _int8_round.fit(proto, units, case.cal, scales)
    assert len(whole) >= 2
    monkeypatch.setattr(_int8_round, "BUDGET", 1)
    passes = _int8_round.moments(proto, units, case.cal, scales)
    held: list = []
    count = 0
    for fitted, _, parts, _ in passes:
        gc.collect()
        assert all(r() is None for r in held), "the previous pass's moments are still held"
        held = [weakref.ref(m) for ms in parts.values() for m in ms]
        assert len(fitted) <= 1 and held
        count += 1
        del fitted, parts
    assert count >= len(whole)
    split = _int8_round.fit(proto, units, case.cal, scales)
    assert sorted(split) == sorted(whole)
    assert all(np.array_equal(split[w], whole[w]) for w in whole)


@pytest.mark.parametrize("apart", ["sampled", "over the budget"])
def test_folds_fit_layers_apart_as_the_three_fits_do(int8_prepared, monkeypatch, apart):
    """Trained MTCNN PNet with the patches kept per batch cut to 256, so that every layer's
    are sampled, or with the moments' budget cut below any layer's four quarters: ``folds``
    fits those layers apart and gives the codes of the three ``fit`` calls (each of which
    drew its samples in turn over its passes)."""
    from fp16lens.export import _int8_round
    from fp16lens.export._int8_search import QMAX, collect

    case, proto, units = int8_prepared("pnet", 8, 1)
    hists, _ = collect(proto, units, case.cal)
    scales = {t: hists[t].candidates()["max"] / QMAX for t in hists}
    drawn = []
    products = _int8_round._products

    def counted(cols, scale, rng):
        drawn.append(cols.shape[-1] > _int8_round.SAMPLES)
        return products(cols, scale, rng)

    monkeypatch.setattr(_int8_round, *(("SAMPLES", 256) if apart == "sampled" else ("BUDGET", 1)))
    monkeypatch.setattr(_int8_round, "_products", counted)
    feeds = list(case.cal)
    folds = _int8_round.folds(proto, units, feeds, scales)
    assert drawn and all(drawn) == (apart == "sampled") and any(drawn) == (apart == "sampled")
    calls = [_int8_round.fit(proto, units, f, scales) for f in (feeds[:4], feeds[4:], feeds)]
    assert any(calls)
    for got, want in zip(folds, calls):
        assert sorted(got) == sorted(want)
        assert all(np.array_equal(got[w], want[w]) for w in want)


def test_folds_are_the_three_fits_the_search_made(int8_prepared):
    """Trained MTCNN PNet on 8 calibration photos: ``folds`` (one pass over the batches)
    gives the codes of ``fit`` on the first 4, on the last 4 and on all 8, each called on
    its own, to the code; the three differ from each other."""
    from fp16lens.export import _int8_round
    from fp16lens.export._int8_search import QMAX, collect

    case, proto, units = int8_prepared("pnet", 8, 1)
    hists, _ = collect(proto, units, case.cal)
    scales = {t: hists[t].candidates()["max"] / QMAX for t in hists}
    feeds = list(case.cal)
    folds = _int8_round.folds(proto, units, feeds, scales)
    calls = [_int8_round.fit(proto, units, f, scales) for f in (feeds[:4], feeds[4:], feeds)]
    for got, want in zip(folds, calls):
        assert want and sorted(got) == sorted(want)
        assert all(np.array_equal(got[w], want[w]) for w in want)
    assert sorted(calls[0]) != sorted(calls[1]) or any(
        not np.array_equal(calls[0][w], calls[1][w]) for w in calls[0]
    )
    with pytest.raises(ValueError, match="two calibration batches"):
        _int8_round.folds(proto, units, feeds[:1], scales)


def test_gptq_beats_nearest_on_correlated_inputs_and_keeps_exact_weights():
    """The algorithm on its own: rows whose inputs are correlated (a pixel's neighbours)
    get a smaller layer error ``|(W - Ŵ) x|`` on fresh inputs than nearest rounding; a
    weight already on the grid stays where it is."""
    from fp16lens.export._int8_round import gptq

    rng = np.random.default_rng(0)
    k, r = 27, 16
    mix = rng.standard_normal((k, k)) * 0.3 + np.eye(k) + 1.0  # correlated, with a mean
    fit, fresh = rng.standard_normal((2, k, 4096))
    x, y = mix @ fit, mix @ fresh
    w = rng.standard_normal((1, r, k))
    scale = np.abs(w).max(-1) / 127
    q = gptq(w, scale, (x @ x.T)[None])
    nearest = np.clip(np.rint(w / scale[..., None]), -127, 127)
    assert np.abs(q).max() <= 127 and np.abs(q - nearest).max() <= 2

    def err(codes):
        return float(np.sum(((w - codes * scale[..., None])[0] @ y) ** 2))

    assert err(q) < 0.7 * err(nearest)
    on_grid = nearest * scale[..., None]
    assert np.array_equal(gptq(on_grid, scale, (x @ x.T)[None]), nearest.astype(np.int8))


def test_the_fit_takes_the_inputs_quantization_into_account():
    """Inputs most of which lie under one INT8 step of a per-tensor scale (channels behind
    a hardswish): the codes fitted to ``|W x - Ŵ x̂|`` (``x̂`` the quantized inputs) give a
    smaller error on fresh inputs than rounding fitted to ``x`` alone (GPTQ as published),
    and than the nearest."""
    from fp16lens.export._int8_round import Moments, _solve, gptq, quantized

    rng = np.random.default_rng(1)
    k, r = 32, 24
    widths = np.geomspace(0.02, 8.0, k)[:, None]  # one wide channel sets the scale

    def inputs(n):
        return np.maximum(rng.standard_normal((k, n)) * widths, -0.1).astype(np.float32)

    def moments(x):
        q = quantized(x, 8.0 * 3 / 127).astype(np.float64)
        x = x.astype(np.float64)
        return Moments((x @ x.T)[None], (q @ x.T)[None], (q @ q.T)[None])

    fit, fresh = moments(inputs(8192)), moments(inputs(8192))
    w = rng.standard_normal((1, r, k))
    scale = np.abs(w).max(-1) / 127
    nearest = np.clip(np.rint(w / scale[..., None]), -127, 127)
    errors = {
        name: fresh.error(w, codes * scale[..., None])
        for name, codes in (
            ("nearest", nearest),
            ("gptq on x", gptq(w, scale, fit.xx)),
            ("fitted", _solve(w, scale, fit)),
        )
    }
    assert errors["fitted"] < 0.8 * min(errors["nearest"], errors["gptq on x"]), errors


def test_the_written_file_holds_the_fitted_codes_and_gains_on_held_out_items():
    """MTCNN PNet (facenet-pytorch's trained weights): the search keeps the rounding and
    the bias correction together (judged side by side with each alone on held-out halves
    of the calibration batches: checked after a rounding fitted on every batch, the bias
    correction was left out), the written file's INT8 weights are exactly those codes on
    the nearest rounding's scales, and on 24 held-out photo crops its outputs are closer
    to FP32 than the same search's with bias correction alone or rounding alone, its
    largest change of a cell's face probability too."""
    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._int8_search import nmse, quantize_weight, searcher, write_qdq

    try:
        case = int8_zoo.MODELS["pnet"](8, 24)
    except int8_zoo.Missing as exc:
        pytest.skip(str(exc))
    proto = prepared(onnx.load(case.path))
    name_nodes(proto.graph)
    fitted = searcher(proto, list(case.cal)).plan
    plain = searcher(proto, list(case.cal), round_weights=False).plan
    alone = searcher(proto, list(case.cal), correct_bias=False).plan
    kept = "weight rounding and bias correction kept ("
    assert any(n.startswith(kept) for n in fitted.notes), fitted.notes
    assert fitted.rounded and fitted.corrections, fitted.notes
    assert not plain.rounded and plain.corrections and alone.rounded and not alone.corrections
    written = write_qdq(proto, fitted)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in written.graph.initializer}
    source = {
        i.name: onnx.numpy_helper.to_array(i)
        for i in (fitted.graph or proto).graph.initializer  # the grid encoding's weights
    }
    changed = 0
    for w, codes in fitted.rounded.items():
        assert np.array_equal(inits[f"{w}_quantized"], codes)
        axis = next(u.axis for u in fitted.units if u.weight == w)
        nearest, scale = quantize_weight(source[w], axis)
        assert np.array_equal(inits[f"{w}_scale"], scale)  # the nearest rounding's scales
        changed += int(np.count_nonzero(codes != nearest))
    assert changed > 0
    refs = int8_zoo.run_outputs(proto, case.eval)
    outs = {
        name: int8_zoo.run_outputs(write_qdq(proto, p), case.eval)
        for name, p in (("both", fitted), ("bias", plain), ("rounding", alone))
    }
    errors = {name: nmse(refs, o) for name, o in outs.items()}
    assert errors["both"] < 0.9 * errors["bias"] and errors["both"] < errors["rounding"], errors
    face = {name: int8_zoo.pnet_metric(refs, o)["face prob error"] for name, o in outs.items()}
    assert face["both"] < 0.9 * min(face["bias"], face["rounding"]), face
