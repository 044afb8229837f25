"""The Fixing table: for each model and each fix, the share of Conv/Gemm/MatMul FLOPs left
in FP16, the parity reached on verify's faithful ``onnx-fp16`` backend (FP16 storage made
real on the CPU, whichever tool wrote the Casts), and the nodes each fix adds."""

from __future__ import annotations

import functools
import math
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import torch

import fp16lens
from peers import models_big, tools
from peers.flops import fp16_share, fp32_nodes

QUICK_MODELS = ("seed_case", "gelu_span", "bn_huge_var", "layernorm_variance")
FULL_MODELS = (
    *QUICK_MODELS,
    "resnet50 (planted)",
    "bert-base (planted)",
    "vit (residual stream)",
    *models_big.ONNX_CASES,
)
TUNED_GRID = {True: (8192.0,), False: (2048.0, 8192.0, 32768.0)}
"""data_max values tried for AutoCast's tuned row (quick / full): the largest that passes."""


def tool_table(quick: bool) -> dict[str, Callable[[tools.Case], dict]]:
    """Row label -> function measuring that fix on a case."""
    return {
        "no fix (all FP16)": _measured(tools.all_fp16),
        "fp16lens patch": _measured(tools.fp16lens_fix),
        "AutoCast data_max=512": _measured(functools.partial(tools.autocast, data_max=512.0)),
        "AutoCast tuned data_max": functools.partial(_autocast_tuned, grid=TUNED_GRID[quick]),
        "onnxconverter-common + block list": _measured(tools.blocked_span),
    }


def fixing_rows(model_names=None, quick: bool = False, only=None) -> list[dict]:
    """One row per (model, fix); a fix that cannot run is a row with its error."""
    names = model_names or (QUICK_MODELS if quick else FULL_MODELS)
    table = tool_table(quick)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        for name in names:
            labels = [label for label in table if only is None or label in only]
            try:
                case = prepare(name, Path(tmp))
            except Exception as exc:  # the model's rows say why, the other models still run
                error = {**ERROR_ROW, "note": f"error preparing the model: {describe(exc)}"}
                rows += [{"model": name, "tool": label, **error} for label in labels]
                continue
            rows += [{"model": name, "tool": lb, **_guarded(table[lb], case)} for lb in labels]
    return rows


def prepare(name: str, workdir: Path) -> tools.Case:
    """Build the model, watch it on its inputs, export the FP32 graph every peer starts from."""
    if name in models_big.ONNX_CASES:  # ONNX in: the published file is what every tool gets
        path, inputs = models_big.onnx_file(name)
        report = fp16lens.scan(path, [inputs], progress=False)
        return tools.Case(name.split(" ")[0], path, inputs, report, Path(path), workdir)
    model, inputs = models_big.build(name)
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(*inputs)
    slug = name.split(" ")[0]
    fp32 = workdir / f"{slug}.fp32.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp16lens.export(model, inputs, fp32, precision="fp32")
    return tools.Case(slug, model, inputs, lens.report, fp32, workdir)


def measure(case: tools.Case, fix: tools.Fix) -> dict:
    """FLOP share, parity and added nodes of one written FP16 file."""
    proto = onnx.load(str(fix.path))
    base = len(onnx.load(str(case.fp32_path), load_external_data=False).graph.node)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parity = fp16lens.verify(case.model, str(fix.path), case.inputs, backend="onnx-fp16")
    return {
        "FP16 FLOPs %": round(100 * _share(case, proto), 1),
        "parity": "pass" if parity else "FAIL",
        "cosine": _finite(parity.cosine),
        "non-finite": bool(parity.nonfinite),
        "extra nodes": len(proto.graph.node) - base,
        "FP32 nodes": fp32_nodes(proto),
        "note": _with_departure(fix.note, parity),
    }


def _share(case: tools.Case, proto) -> float:
    """FP16 FLOP share; an ONNX-in case counts FLOPs on the published FP32 file's shapes."""
    if not isinstance(case.model, str):
        return fp16_share(proto)
    reference = onnx.load(str(case.fp32_path))
    return fp16_share(proto, [tuple(t.shape) for t in case.inputs], reference=reference)


def _with_departure(note: str, parity) -> str:
    """The fix's note, plus where a failing candidate first departs (verify's locate)."""
    where = getattr(parity, "first_divergence", None)
    if parity or not where:
        return note
    return f"{note}; first departs at {where}" if note else f"first departs at {where}"


def _finite(x: float) -> float | str:
    """Rounded, or "nan" (keeps the JSON output valid)."""
    return round(float(x), 6) if math.isfinite(x) else "nan"


def _measured(fix_fn: Callable[[tools.Case], tools.Fix]) -> Callable[[tools.Case], dict]:
    return lambda case: measure(case, fix_fn(case))


def _autocast_tuned(case: tools.Case, grid: tuple[float, ...]) -> dict:
    """The largest data_max in ``grid`` whose file passes parity (else the smallest tried)."""
    row: dict = {}
    for data_max in sorted(grid, reverse=True):
        row = measure(case, tools.autocast(case, data_max))
        if row["parity"] == "pass":
            break
    tried = "/".join(f"{v:g}" for v in sorted(grid))
    return {**row, "note": f"{row['note']} (largest passing of {tried})"}


ERROR_ROW = {
    "FP16 FLOPs %": "-",
    "parity": "-",
    "cosine": "-",
    "non-finite": "-",
    "extra nodes": "-",
    "FP32 nodes": "-",
}


def _guarded(measure_fn, case: tools.Case) -> dict:
    """The measured row, or the error that stopped the tool (never a dropped row)."""
    try:
        return measure_fn(case)
    except Exception as exc:  # a peer failing on a model is a result, not a crash
        return {**ERROR_ROW, "note": f"error: {describe(exc)}"}


def describe(exc: BaseException) -> str:
    """One line naming the failure; a missing package says which one."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(exc, ImportError):
        return f"not installed ({exc.name or first}); pip install -e '.[peers]'"
    return f"{type(exc).__name__}: {first}"[:200]
