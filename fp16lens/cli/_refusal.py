"""Whether an error came from the user's model refusing its inputs, not from fp16lens.

A command that fails with an exception that is not an ``Fp16LensError`` runs the model
once more on the failing command's first batch, plainly (no watch, no rewrite, under
``torch.no_grad``). If the model fails there too, the inputs are the problem (a 4-channel
input for a 3-channel conv, floats for token ids, two arrays for a one-input model) and
the CLI says so in one line; if it runs, the error is a bug of fp16lens and keeps its
traceback. Only failures pay for the extra forward.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

PROBE_ATTR = "_fp16lens_probe"
"""The (model, first batch) a command ran, set on its argparse namespace."""


def remember(args: argparse.Namespace, model, batches: Sequence) -> None:
    """Keep what ``refusal`` re-runs when the command fails."""
    if model is not None and batches:
        setattr(args, PROBE_ATTR, (model, batches[0]))


def refusal(args: argparse.Namespace, exc: BaseException) -> str | None:
    """One line naming the inputs and what the model said, or None (not the inputs)."""
    probe = getattr(args, PROBE_ATTR, None)
    if _onnx_feed_error(exc):  # ONNX Runtime checks every feed against the graph's inputs
        said = _onnx_said(str(exc))
        batch = f" ({describe(probe[1])})" if probe else ""
        fixed = re.search(r"index: 0 Got: (\d+) Expected: (\d+)", said)
        split = (
            f"; --batch-size {fixed[2]} splits a file's batch along its first axis"
            if fixed and int(fixed[1]) > int(fixed[2])
            else ""
        )
        return (
            f"an ONNX file refused the inputs{batch}: {said}; check that the ONNX file was "
            f"exported from this model, and give inputs of the shapes its graph declares{split}"
        )
    if probe is None:
        return None
    import torch

    from fp16lens._trace import call_model

    model, batch = probe
    try:
        with torch.no_grad():
            call_model(model, batch)
    except Exception as again:  # the model itself refuses the batch
        said = (str(again).strip().splitlines() or [""])[0]
        return (
            f"the model refused its input ({describe(batch)}): {type(again).__name__}: {said}; "
            "give inputs of the shapes, dtypes and value ranges the model takes "
            "(--input SHAPE|FILE, --dtype, --range)"
        )
    return None


def _onnx_said(message: str) -> str:
    """ONNX Runtime's complaint on one line: its lines joined (the dimensions it names come
    on the lines after the first), its closing advice left out."""
    said = message.split("INVALID_ARGUMENT :")[-1]
    said = re.sub(r"Please fix either the inputs.*?model\.", "", said, flags=re.S)
    return " ".join(said.split())


def _onnx_feed_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("onnxruntime") and "INVALID_ARGUMENT" in str(exc)


def describe(batch) -> str:
    """``x 1x4x64x64 float32, 1x8 int64``: each input's shape and dtype (names for dicts)."""
    items = (
        batch.items()
        if isinstance(batch, dict)
        else enumerate(batch if isinstance(batch, (tuple, list)) else (batch,))
    )
    parts = []
    for key, value in items:
        shape = getattr(value, "shape", None)
        what = (
            "x".join(str(int(d)) for d in shape) + " " + str(value.dtype).removeprefix("torch.")
            if shape is not None
            else type(value).__name__
        )
        parts.append(f"{key} {what}" if isinstance(key, str) else what)
    return f"{len(parts)} input{'s' if len(parts) != 1 else ''}: " + ", ".join(parts)
