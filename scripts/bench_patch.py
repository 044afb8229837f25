"""patch() on the seed case, and the fold against the seed article's runtime forms.

    python scripts/bench_patch.py [--repeat 3]

Prints (1) for p in {8, 32, 256, 4096} the FP32 error (max |error| / max |truth|, truth in
float64) of folding the power of two into the parameters versus the article's runtime
forms warp_conv, warp_bn and p*w2(relu((w1 x + b1)/p)) - (p-1)*b2; (2) on the seed case:
plan/patch wall time, the regions and factors, FP32 equivalence, the .half() output
before and after (non-finite count, cosine vs FP32) and the ONNX node counts.
"""

from __future__ import annotations

import argparse
import copy
import io
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "patch")]

from test_patch_baselines import P_VALUES, bn_errors, conv_errors, span_errors  # noqa: E402

import fp16lens  # noqa: E402
from fp16lens.patch import get_plan, patch, plan, relative_error  # noqa: E402

from models import seed_case  # noqa: E402


def baselines(console: Console) -> None:
    t = Table(title="FP32 error: fold vs the seed's runtime forms (max|err|/max|truth|)")
    for col in ("p", "conv fold", "warp_conv", "bn fold", "warp_bn", "span fold", "span formula"):
        t.add_column(col, justify="right")
    for p in P_VALUES:
        row = [*conv_errors(p), *bn_errors(p), *span_errors(p)]
        t.add_row(f"{p:g}", *(f"{e:.2e}" for e in row))
    console.print(t)


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


@torch.no_grad()
def _half(model, inputs):
    return copy.deepcopy(model).half()(*(a.half() for a in inputs)).float()


def _onnx_nodes(model, inputs) -> int | str:
    try:
        import onnx
    except ImportError:
        return "onnx missing"
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, buf, dynamo=False, opset_version=17)
    return len(onnx.load_from_string(buf.getvalue()).graph.node)


def seed(console: Console, repeat: int) -> None:
    model, inputs = seed_case()
    with fp16lens.watch(model) as lens, torch.no_grad():
        model(*inputs)
    report = lens.report
    t_plan, the_plan = _best(lambda: plan(model, report), repeat)
    t_patch, patched = _best(lambda: patch(model, report), repeat)
    console.print(get_plan(patched))
    with torch.no_grad():
        want = model(*inputs)
        fp32_err = relative_error(want, patched(*inputs))
    t = Table(title="seed case (resnet18 + FPN, 1x3x64x64)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("plan() / patch() wall time", f"{t_plan * 1e3:.0f} ms / {t_patch * 1e3:.0f} ms")
    t.add_row(
        "regions (factor)",
        ", ".join(f"{len(r.sites)} sites (x1/{r.factor:g})" for r in the_plan.regions),
    )
    t.add_row("FP32 relative error patched vs original", f"{fp32_err:.2e}")
    for name, m in (("original", model), ("patched", patched)):
        h = _half(m, inputs)
        cos = float(F.cosine_similarity(want.flatten().double(), h.flatten().double(), dim=0))
        t.add_row(
            f".half() {name}: non-finite / cosine", f"{int((~torch.isfinite(h)).sum())} / {cos:.6f}"
        )
    t.add_row(
        "ONNX nodes original / patched",
        f"{_onnx_nodes(model, inputs)} / {_onnx_nodes(patched, inputs)}",
    )
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    console = Console()
    baselines(console)
    seed(console, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
