"""An INT8 file whose float parts fail in FP16, made again from its FP32 graph patched
for FP16 first.

``_export._float_parts_in_fp16`` checks the INT8 file with every tensor a node writes
stored in FP16, as a weakly typed TensorRT build with FP16 beside INT8 may compute what is
not INT8. Where that fails, the tensors beyond FP16 are the FP32 graph's own (Silero VAD
fed raw int16 samples: its STFT's power, 32768² > 65504, and an encoder whose values
reach 1e8). They are what ``fp16lens.patch`` fixes: its power-of-two rescaling is exact
in FP32 and INT8 is equivariant to it (a scale of 2^k moves every quantization step by
2^k), so the patched graph quantizes as the original does, with FP32 islands only where
no rescaling applies (those stay out of INT8 and are pinned FP32 in a weakly typed
build, as every FP16 island is).

So the FP32 graph (an ONNX source, or the graph exported from a PyTorch model) is
scanned and patched on the calibration batches (proven there in real FP16), quantized
again with the same options, and the new file is checked against the user's model (the
ONNX source, or the PyTorch model) on the evaluation batches, both ways. It replaces the
first file only where both checks pass; otherwise the first file stays, and its warning
says what patching gave.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path

from fp16lens.export._artifact import ExportArtifact


def failed_in_fp16(artifact: ExportArtifact) -> bool:
    """Whether the INT8 file passed its check as written and failed with its float parts
    in FP16."""
    rest = (artifact.int8 or {}).get("float_parts_fp16") or {}
    passed = artifact.parity is not None and artifact.parity.passed
    return passed and rest.get("passed") is False


def patched_first(source, path: Path, calibration: list, evaluation, artifact, again, check):
    """The INT8 file of ``source`` (an FP32 ONNX graph) patched for FP16 first, where
    ``artifact`` (its INT8 file at ``path``) failed with its float parts in FP16; else
    ``artifact``. ``again(src, dst)`` exports ``src`` to ``dst`` with the caller's options
    (no check on the evaluation batches); ``check(artifact)`` checks an INT8 artifact
    against the user's model on them."""
    if not failed_in_fp16(artifact) or not calibration:
        return artifact
    before = float((artifact.int8 or {})["float_parts_fp16"]["cosine"])
    with tempfile.TemporaryDirectory() as tmp:
        try:
            patched, plan = _patched(source, calibration, Path(tmp) / "patched.onnx")
        except Exception as exc:  # patch refused: said, not raised
            return _said(artifact, f"patching the FP32 graph for FP16 first failed ({_first(exc)})")
        if not plan.changes:
            return _said(artifact, "patch finds nothing to change in the FP32 graph")
        made = Path(tmp) / "int8"
        try:
            second = again(str(patched), made / path.name)
        except Exception as exc:  # the second export refused (a target missed): said
            return _said(
                artifact,
                f"the INT8 export of the FP32 graph patched for FP16 fails ({_first(exc)})",
            )
        checked = check(replace(second, path=made / path.name, parity=None))
        rest = (checked.int8 or {}).get("float_parts_fp16") or {}
        if checked.parity is not None and checked.parity.passed and rest.get("passed") is True:
            moved = _moved(made, path, checked, artifact.calibration_cache)
            return replace(moved, warnings=(*moved.warnings, _note(plan, before, checked)))
        how = "its check as written fails" if not checked.parity else "with its float parts in FP16"
        cos = rest.get("cosine")
        got = f" (worst output cosine {cos:.6f})" if cos is not None and checked.parity else ""
        target, score = (checked.int8 or {}).get("target"), rest.get("target_score")
        if checked.parity and target and score is not None and score < target["threshold"]:
            got = (  # verify's check holds there; the target given does not
                f" ({target['metric']} {score:.6f} < {target['threshold']:.12g}, its target; "
                f"{target['score']:.6f} as written)"
            )
        return _said(
            artifact, f"the INT8 file of the FP32 graph patched for FP16 fails too: {how}{got}"
        )


def _first(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _patched(source, calibration: list, out: Path):
    """``source`` scanned and patched on the calibration batches, written to ``out``; the
    plan (its PatchWarnings held back: the export says what matters)."""
    from fp16lens.patch import PatchOptions
    from fp16lens.patch.onnx import patch_onnx
    from fp16lens.watch import scan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = scan(source, calibration, progress=False)
        _, plan = patch_onnx(source, report, PatchOptions(), out=out, batches=list(calibration))
    return out, plan


def _moved(made: Path, path: Path, artifact: ExportArtifact, cache_to) -> ExportArtifact:
    """Every file the second export wrote in ``made`` moved where the first export's are
    (``path``'s folder; its calibration cache to ``cache_to``), replacing them, and the
    artifact naming them there."""
    cache = Path(artifact.calibration_cache) if artifact.calibration_cache else None
    for f in made.iterdir():
        to = (
            Path(cache_to)
            if cache is not None and cache_to and f == cache
            else path.parent / f.name
        )
        shutil.move(str(f), str(to))
    return replace(artifact, path=path, calibration_cache=Path(cache_to) if cache else None)


def _note(plan, before: float, checked: ExportArtifact) -> str:
    rest = (checked.int8 or {})["float_parts_fp16"]
    kept = [i.module for i in plan.islands]
    names = ", ".join(kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
    return (
        f"with its float parts in FP16 the INT8 file failed (worst output cosine {before:.6f}: "
        "values beyond FP16 in the FP32 graph itself), so that graph was patched for FP16 "
        f"first ({len(plan.regions)} region(s) rescaled by powers of two, exact in FP32"
        + (f"; {len(kept)} node(s) kept FP32: {names}" if kept else "")
        + f") and quantized again: it passes as written (worst output cosine "
        f"{checked.parity.cosine:.6f}) and with its float parts in FP16 ({rest['cosine']:.6f}), "
        "checked against the model on the evaluation batches"
    )


def _said(artifact: ExportArtifact, what: str) -> ExportArtifact:
    """The first file's FP16 warning with ``what`` patching gave added."""
    out = []
    for w in artifact.warnings:
        if w.startswith("with its float parts in FP16"):
            w = f"{w}; {what}"
        out.append(w)
    return replace(artifact, warnings=tuple(out))
