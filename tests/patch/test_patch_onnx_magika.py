"""Magika (Google's file-type detector; the magika 1.0.3 wheel's ``standard_v3_3``, a JAX
export: int32 bytes in, two LayerNorms, a decomposed tanh-GELU, 214 labels out), fed the
bytes of real files as magika reads them.

Ground truth without fp16lens: the FP32 graph with real FP16 storage
(``zoo_real.onnx_real_fp16``) calls every file "javascript": the second LayerNorm's sum of
squares passes 65504. For the fix, the FP16 file fp16lens exports, with its FP16 storage
made real (``zoo_real.onnx_fp16_file_real``), on files the patch never saw."""

from __future__ import annotations

import io
import os
import sys
import warnings
import zipfile

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import zoo_real  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens.cli import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def magika():
    return zoo_real.or_skip(zoo_real.magika_model)


def _files() -> dict[str, bytes]:
    """Real files of seven types: this project's source, speech, docs and config, a
    scikit-image photograph, the Python executable, and a zip of the speech and photo."""

    def read(*parts: str) -> bytes:
        with open(os.path.join(ROOT, *parts), "rb") as f:
            return f.read()

    with open(zoo_real.or_skip(zoo_real.skimage_file, "coffee.png"), "rb") as f:
        png = f.read()
    with open(os.path.realpath(sys.executable), "rb") as f:
        elf = f.read()
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as z:
        for name in ("speech_16k.wav", "speech2_16k.wav"):  # dated 1980: the same bytes
            z.writestr(zipfile.ZipInfo(name), read("tests", "data", name))
        z.writestr(zipfile.ZipInfo("coffee.png"), png)
    return {
        "python": read("fp16lens", "patch", "_patch.py"),
        "wav": read("tests", "data", "speech_16k.wav"),
        "markdown": read("docs", "DESIGN.md"),
        "ini": read("setup.cfg"),
        "png": png,
        "elf": elf,
        "zip": packed.getvalue(),
    }


def _label(labels: list[str], out: np.ndarray) -> str:
    return labels[int(out.argmax())] if np.isfinite(out).all() else "NaN"


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_magika_broken_in_real_fp16_is_found_and_the_exported_fix_reads_unseen_files(
    magika, tmp_path, capsys
):
    """Real FP16 names every file wrongly; the scan says so (a span at the LayerNorm's
    sum); patch, proven on two files, writes a valid graph, and its FP16 export, in real
    FP16 storage, names all seven files as FP32 does, five of them never seen. The
    decomposed GELU's x³ also passes 65504 on speech, but its tanh takes the inf to 1
    as FP32 does: patch leaves it, warns, and says the proof passed anyway."""
    path, labels = magika
    feeds = {kind: {"bytes": zoo_real.magika_bytes(data)} for kind, data in _files().items()}
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    refs = {kind: session.run(None, feed)[0] for kind, feed in feeds.items()}
    for kind, feed in feeds.items():
        ref = refs[kind]
        assert _label(labels, ref) == kind  # FP32 reads each file's type
        (half,) = zoo_real.onnx_real_fp16(path, feed).values()
        assert _label(labels, half) == "javascript"  # ground truth: real FP16 misreads all
    calibration = [feeds["python"], feeds["wav"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = fp16lens.scan(path, calibration, progress=False)
    assert not report.clean and any("LayerNorm_1/Sum_1" in s.start for s in report.spans)
    assert not [f for f in report.findings if f.mechanism == "parameter"]  # -inf stays -inf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16lens.patch(path, report, batches=calibration, out=tmp_path / "patched.onnx")
    said = " ".join(str(w.message) for w in caught if w.category is fp16lens.PatchWarning)
    assert "yet real FP16 of the patched model passed on every batch given" in said
    assert "ApplyActivation_1/Tanh" in said and "not FP16-safe" not in said
    # an ONNX graph's islands are nodes: the advice is the option export takes for it
    assert "Keep those nodes in FP32 (export(..., fp32_nodes=[...]))" in said, said
    np.savez(tmp_path / "wav.npz", **feeds["wav"])  # from a terminal: the same, in its words
    saved = tmp_path / "r.json"
    report.save(saved)
    wav, fixed = str(tmp_path / "wav.npz"), str(tmp_path / "cli.onnx")
    code = main(["patch", path, "--report", str(saved), "--input", wav, "-o", fixed])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1 and "proven" in out  # 1: a problem is left, as the help says
    assert "stay out of FP16 range after the patch (real FP16 passed on the --input" in out
    art = fp16lens.export(str(tmp_path / "patched.onnx"), None, tmp_path / "fp16.onnx")
    for kind, feed in feeds.items():
        ref = refs[kind]
        (got,) = zoo_real.onnx_fp16_file_real(str(art.path), feed).values()
        assert _label(labels, got) == kind and _cosine(ref, got) >= 0.9999, kind
