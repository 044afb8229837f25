"""torch.onnx.export, dynamo first and TorchScript as the fallback, to an in-memory ModelProto."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from fp16lens._core import ExportError, import_optional
from fp16lens._core.compat import TORCH_VERSION
from fp16lens._core.quiet import plain, quiet

_PURPOSE = "ONNX export"


def export_fp32(
    model: torch.nn.Module, args: tuple, exporter: str, opset: int | None, io: dict | None = None
) -> tuple[Any, str, list[str]]:
    """Export ``model(*args)`` in FP32. Returns (ModelProto, exporter used, warnings).
    ``io``: input/output names and dynamic axes (``_io.IoSpec.kwargs()``)."""
    io = io or {}
    import_optional("onnx", "onnx", _PURPOSE)
    notes: list[str] = []
    if exporter in ("auto", "dynamo") and TORCH_VERSION < DYNAMO_FROM:
        older = f"torch {torch.__version__} has no dynamo ONNX exporter that returns a model (torch 2.5 and later)"
        if exporter == "dynamo":
            raise ExportError(
                f"{older}; use exporter='torchscript' (--exporter torchscript), or upgrade torch"
            )
        notes.append(f"{older}; used the TorchScript exporter")
        exporter = "torchscript"
    if exporter in ("auto", "dynamo"):
        try:
            return _dynamo(model, args, opset, io), "dynamo", notes
        except Exception as exc:  # torch raises many kinds; fall back or re-raise below
            if exporter == "dynamo":
                raise ExportError(
                    f"torch's dynamo ONNX exporter failed: {exc}. "
                    "Try exporter='torchscript', or fix the model for torch.export."
                ) from exc
            notes.append(
                f"dynamo exporter failed ({type(exc).__name__}: {_first_line(exc)}); "
                "used the TorchScript exporter instead"
            )
    try:
        return _torchscript(model, args, opset, io), "torchscript", notes
    except Exception as exc:
        if isinstance(model, torch.jit.ScriptModule) and "prim::DictConstruct" in str(exc):
            raise ExportError(
                "this TorchScript model returns a dict (a transformers ModelOutput, say), which "
                "torch's ONNX exporter cannot export from TorchScript; save the model as a "
                "torch.export program instead (`fp16lens patch ... -o patched.pt2`) and export that"
            ) from exc
        raise ExportError(
            f"torch.onnx.export failed with the TorchScript exporter: {_first_line(exc)}. "
            "Check that the model runs on the example inputs and traces without data-dependent control flow."
        ) from exc


DYNAMO_FROM = (2, 5)
"""``torch.onnx.export(dynamo=True, external_data=...)`` returning an ONNXProgram."""


def _dynamo(model: torch.nn.Module, args: tuple, opset: int | None, io: dict):
    import_optional("onnxscript", "onnx", _PURPOSE)
    kwargs = dict(io) if opset is None else {"opset_version": opset, **io}
    with quiet("torch.onnx"):
        program = torch.onnx.export(
            model, args, dynamo=True, external_data=False, verbose=False, **kwargs
        )
    return program.model_proto


def _torchscript(model: torch.nn.Module, args: tuple, opset: int | None, names: dict):
    """Through a file in a temporary folder: the TorchScript exporter writes a model over
    protobuf's 2 GB limit only to a path, its weights in external data files beside it;
    the file is read back whole, as the dynamo exporter's proto is."""
    onnx = import_optional("onnx", "onnx", _PURPOSE)
    with tempfile.TemporaryDirectory(prefix="fp16lens-export-") as folder:
        path = Path(folder) / "model.onnx"
        with quiet("torch.onnx"):
            torch.onnx.export(
                model,
                args,
                str(path),
                dynamo=False,
                opset_version=opset or 18,
                do_constant_folding=True,
                **names,
            )
        return onnx.load(str(path), load_external_data=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return plain(text[0])[:200] if text else ""
