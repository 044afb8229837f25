"""The real-weights zoo's ONNX files converted to FP16 as users convert them, each scanned
by fp16lens and checked against real FP16, one row per file and input.

Conversion: onnxconverter-common's ``convert_float_to_float16(keep_io_types=True)``.
Ground truth, made without fp16lens: ONNX's reference evaluator runs the FP16 file in
numpy's float16 (every node's output stored in FP16, as the file says; its batch norm made
an inference one, ``tests/onnx_reference.py``), against ONNX Runtime on the FP32 file it was
converted from: finite, the cosine per output, and for the detector the text-mask IoU.

    python scripts/sweep_fp16_files.py            # every file and input below
    python scripts/sweep_fp16_files.py det-raw    # the named rows only
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import zoo_real as z
from onnx_reference import run_reference


def cases():
    """(row name, FP32 file, input maker)."""
    yield "det-norm", z.rapidocr_model("det"), lambda: z.ppocr_det(True)[1]
    yield "det-raw", z.rapidocr_model("det"), lambda: z.ppocr_det(False)[1]
    yield "yolo", z.nudenet_yolo(), lambda: z.yolo_image("astronaut")
    yield "yolo-raw", z.nudenet_yolo(), lambda: z.yolo_image("astronaut", raw=True)
    yield "orient", z.orientation_model(), lambda: z.orientation_image("page")
    yield "orient-raw", z.orientation_model(), lambda: z.orientation_image("page", raw=True)
    yield "ddddocr", z.ddddocr_model("common.onnx"), lambda: z.ddddocr_line(False)
    yield "ddddocr-raw", z.ddddocr_model("common.onnx"), lambda: z.ddddocr_line(True)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / norm) if norm else float(np.array_equal(a, b))  # all 0 against not


def row(name: str, path: str, make, folder: str) -> str:
    import onnx
    import onnxruntime as ort
    from onnxconverter_common import float16

    import fp16lens

    x = np.asarray(make(), np.float32)
    fp32 = onnx.load(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = float16.convert_float_to_float16(fp32, keep_io_types=True)
    file16 = os.path.join(folder, f"{name}.onnx")
    onnx.save(half, file16)
    inits = {t.name for t in fp32.graph.initializer}
    (name_in,) = [i.name for i in fp32.graph.input if i.name not in inits]
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {name_in: x})
    got = run_reference(half, {name_in: x})
    floats = [(g, r) for g, r in zip(got, ref) if g.dtype.kind == "f"]
    finite = all(np.isfinite(g.astype(np.float64)).all() for g, _ in floats)
    cosines = ", ".join(f"{_cosine(g, r):.5f}" for g, r in floats)
    if name.startswith("det"):  # the detector's task: its text mask (probability > 0.3)
        g, r = floats[0]
        union = max(int(((g > 0.3) | (r > 0.3)).sum()), 1)
        cosines += f"; text-mask IoU {((g > 0.3) & (r > 0.3)).sum() / union:.3f}"
    start = time.perf_counter()
    report = fp16lens.scan(file16, [x], progress=False)
    kinds = ", ".join(sorted({str(f.kind) for f in report.findings}))
    return (
        f"| {name} | {'yes' if finite else 'no'} | {cosines} | "
        f"{'FP16-safe' if report.clean else 'not safe'} | {len(report.spans)} | {kinds} | "
        f"{time.perf_counter() - start:.1f} |"
    )


def main(argv: list[str]) -> int:
    print("| file, input | FP16 finite | cosine vs FP32 | verdict | spans | findings | scan s |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name, path, make in cases():
            if argv and name not in argv:
                continue
            try:
                print(row(name, path, make, folder), flush=True)
            except Exception as exc:  # a row's failure is shown, never dropped
                print(f"| {name} | error: {type(exc).__name__}: {exc} | | | | | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
