"""The demo journey: watch -> report -> plan -> patch -> parity -> export, on the built-in
text detector. Everything is printed on the given rich console; a summary dict is returned.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fp16lens._core import MissingDependencyError
from fp16lens._core.paths import check_writable
from fp16lens._core.sites import Backend
from fp16lens.demo._build import document_pages


def _stages() -> dict:
    """Every stage of the journey (imported here: the demo is the last stage's user)."""
    from fp16lens.export import export
    from fp16lens.patch import patch, plan
    from fp16lens.verify import verify
    from fp16lens.watch import watch

    return {"watch": watch, "plan": plan, "patch": patch, "verify": verify, "export": export}


def run_demo(out_dir: str | Path = "fp16lens-demo", console: Console | None = None) -> dict:
    """Run the whole journey on the demo model, writing files to ``out_dir``.

    Returns a summary: ``spans_before``/``spans_after`` (start, end, peak), the parity
    ``cosine_before``/``cosine_after`` (FP32 vs real FP16 on the CPU, verify's
    "torch-fp16" backend), ``fixed``, and ``files`` (name -> path written).
    """
    from fp16lens.demo._build import build_demo_model

    stages = _stages()
    console = console or Console()
    out = check_writable(out_dir, folder=True)  # before the work: nothing written on failure
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, inputs = build_demo_model()
    _intro(console, inputs)
    before = _parity(stages, console, model, model, inputs, "before the fix")
    report = _watch(stages, console, model, inputs, "watch: where FP16 overflows")
    files = {"report": str(report.save(out / "report.json"))}
    patched = _fix(stages, console, model, report, inputs)
    after_report = _watch(stages, console, patched, inputs, "watch again: the patched model")
    after = _parity(stages, console, model, patched, inputs, "after the fix")
    onnx_files, onnx_cosine = _export(stages, console, patched, model, inputs, out)
    files.update(onnx_files)
    summary = _summary(report, after_report, before, after, files, inputs)
    summary["cosine_onnx_fp16"] = onnx_cosine
    summary["seconds"] = round(time.perf_counter() - started, 1)
    console.print(_table(summary))
    return summary


def _intro(console: Console, inputs) -> None:
    shape = "x".join(map(str, inputs[0].shape))
    console.rule("[bold]fp16lens demo")
    console.print(
        "A text detector (ResNet-style backbone + FPN neck, built in, no download) on one "
        f"{shape} page.\nIts last block's batch norm has the large affine weight training can "
        "produce: the seed article's PANet situation."
    )


def _parity(stages, console: Console, model, candidate, inputs, when: str):
    console.rule(f"parity {when}: FP32 vs real FP16 ({Backend.TORCH_FP16})")
    result = stages["verify"](model, candidate, inputs, backend=Backend.TORCH_FP16)
    console.print(result)
    return result


def _watch(stages, console: Console, model, inputs, title: str):
    console.rule(title)
    with stages["watch"](model) as lens, torch.no_grad():
        model(*inputs)
    console.print(lens.report)
    return lens.report


def _fix(stages, console: Console, model, report, inputs):
    """The plan, then the patch, which runs the patched model in real FP16 on ``inputs``."""
    console.rule("plan: the exact power-of-two rescaling")
    console.print(stages["plan"](model, report))
    return stages["patch"](model, report, batches=[inputs])


EXPORTER = "torchscript"
"""torch's TorchScript ONNX exporter: ~1 s here, where dynamo takes ~15 s on 2 CPU cores."""


def _export(stages, console: Console, patched, model, inputs, out: Path):
    """Write the FP16 (and INT8) ONNX; returns (files, cosine of the FP16 ONNX or None)."""
    console.rule("export: typed ONNX for TensorRT")
    files: dict[str, str] = {}
    cosine = None
    try:
        art = stages["export"](
            patched, inputs, out / "demo_fp16.onnx", precision="fp16", exporter=EXPORTER
        )
        files["onnx_fp16"] = str(art.path)
        console.print(f"FP16 ONNX: {art.path}")
        if importlib.util.find_spec("onnxruntime") is None:
            console.print(
                "INT8 ONNX and ONNX parity skipped: pip install -e '.[onnx]'", markup=False
            )
            return files, cosine
        result = stages["verify"](model, art.path, inputs, backend=Backend.ONNX_FP16)
        console.print(result)
        cosine = result.cosine
        pages = document_pages(4, inputs[0].shape[-1], seed=7)
        calibration = [(p.unsqueeze(0),) for p in pages]
        art = stages["export"](
            patched,
            inputs,
            out / "demo_int8.onnx",
            precision="int8",
            calibration=calibration,
            exporter=EXPORTER,
        )
        files["onnx_int8"] = str(art.path)
        console.print(f"INT8 ONNX: {art.path}")
    except MissingDependencyError as exc:
        console.print(f"ONNX export skipped: {escape(str(exc))}")
    return files, cosine


def _spans(report) -> list[dict[str, Any]]:
    return [{"start": s.start, "end": s.end, "peak": s.peak} for s in report.spans]


def _summary(report, after_report, before, after, files, inputs) -> dict[str, Any]:
    return {
        "model": "DemoTextDetector",
        "input_shape": list(inputs[0].shape),
        "spans_before": _spans(report),
        "spans_after": _spans(after_report),
        "cosine_before": _metric(before, "cosine"),
        "cosine_after": _metric(after, "cosine"),
        "nonfinite_before": _metric(before, "nonfinite"),
        "nonfinite_after": _metric(after, "nonfinite"),
        "parity_before": bool(before),
        "parity_after": bool(after),
        "fixed": bool(report.spans) and not after_report.spans and bool(after),
        "files": files,
    }


def _metric(result, name: str):
    value = getattr(result, name, None)
    return float(value) if isinstance(value, (int, float)) and name == "cosine" else value


def _table(summary: dict[str, Any]) -> Table:
    table = Table(title="fp16lens demo: before and after", show_header=True)
    table.add_column("")
    table.add_column("before")
    table.add_column("after")
    table.add_row(
        "spans out of FP16 range",
        str(len(summary["spans_before"])),
        str(len(summary["spans_after"])),
    )
    table.add_row(
        "cosine FP32 vs FP16", _fmt(summary["cosine_before"]), _fmt(summary["cosine_after"])
    )
    table.add_row(
        "inf/NaN in the FP16 output",
        _yes(summary["nonfinite_before"]),
        _yes(summary["nonfinite_after"]),
    )
    if summary.get("cosine_onnx_fp16") is not None:
        table.add_row("cosine FP32 vs FP16 ONNX", "", _fmt(summary["cosine_onnx_fp16"]))
    table.add_row("parity", _verdict(summary["parity_before"]), _verdict(summary["parity_after"]))
    for name, path in summary["files"].items():
        table.add_row(name, "", path)
    return table


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.6f}"


def _yes(flag) -> str:
    return "n/a" if flag is None else ("yes" if flag else "no")


def _verdict(ok: bool) -> str:
    return "[green]pass" if ok else "[red]FAIL"
