"""fp16lens against the tools users would otherwise pick, measured side by side in one run.

Finding: on the watch issue's test models (an activation span, a functional-op
overflow, an internal norm variance, a buffer overflow, a clean control), which tool
finds which problem and how precisely it names the site:
  - fp16lens.watch on the FP32 model;
  - the seed article's hooks (FInspect + fp16_check: module outputs, FP32 run);
  - transformers' DebugUnderflowOverflow (module outputs, run where it is meant to
    run: on the model in half precision, where it stops at the first inf/NaN).
Ground truth comes from real FP16 on this CPU (first op producing inf in .half(),
explicit decomposed FP16 for internal overflow, the half buffer for parameters).
Overhead relative to a plain forward comes from scripts/bench_watch.py.

Fixing (scripts/peers/fixing.py): on the same models, fp16lens's patch against NVIDIA
ModelOpt AutoCast (data_max=512 and a tuned value) and onnxconverter-common with the
problem's nodes blocked: the share of Conv/Gemm/MatMul FLOPs left in FP16, parity on
verify's faithful onnx-fp16 backend, and the nodes each adds. Full mode adds a ResNet-50
and a BERT-base with planted overflows. Exactness (scripts/peers/exactness.py): the fold
against the seed's warp_conv/warp_bn forms (scripts/bench_patch.py's measurements).
A peer that cannot be installed or fails on a model is a row with its error.

    python scripts/bench_peers.py                       # full (about 10 min on 2 CPU cores)
    python scripts/bench_peers.py --quick               # reduced (CI)
    python scripts/bench_peers.py --markdown out.md     # also write the docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import bench_watch  # noqa: E402
from peers.exactness import exactness_rows  # noqa: E402
from peers.fixing import fixing_rows  # noqa: E402
from peers.markdown import compared_with  # noqa: E402

import fp16lens  # noqa: E402

import models  # noqa: E402

CASES = {
    "activation span": ("seed_case", "output"),
    "functional-op overflow": ("functional_mul", "output"),
    "internal norm variance": ("layernorm_variance", "internal"),
    "buffer overflow": ("bn_huge_var", "parameter"),
    "clean control": ("clean", None),
}


def truth(name: str, model, inputs) -> str:
    """What real FP16 does, independent of every tool."""
    if name == "layernorm_variance":
        x = model.proj(inputs[0]).detach().half()
        d = x - x.mean(-1, keepdim=True)
        return "norm: (x-mean)^2 inf in decomposed FP16" if torch.isinf(d * d).any() else "none"
    if name == "bn_huge_var":
        return (
            "bn.running_var inf in FP16"
            if torch.isinf(model.bn.running_var.half()).any()
            else "none"
        )
    first = models.first_inf_site_fp16(model, inputs)
    return "none" if first is None else f"{first[0] or '<root>'} ({first[1]})"


def by_fp16lens(model, inputs, mechanism) -> str:
    with torch.no_grad(), fp16lens.watch(model) as lens:
        model(*inputs)
    r = lens.report
    if mechanism == "output" and r.spans:
        s = r.spans[0]
        return f"span {s.start} -> {s.end or 'output'}"
    hits = [f for f in r.findings if f.mechanism == mechanism] if mechanism else []
    if hits:
        f = hits[0]
        return f"{f.mechanism} {f.kind} at {f.site}" + (
            f".{f.tensor}" if f.mechanism == "parameter" else ""
        )
    other = [f for f in r.findings if f.mechanism != "note"] + r.spans
    return "nothing" if not other else f"other: {len(other)} items"


def by_seed_hooks(model, inputs) -> str:
    names = {m: n for n, m in model.named_modules()}
    found: list[str] = []

    def check(module, args, output):
        ins = [
            t
            for t in torch.utils._pytree.tree_flatten(args)[0]
            if torch.is_tensor(t) and t.is_floating_point()
        ]
        outs = [
            t
            for t in torch.utils._pytree.tree_flatten(output)[0]
            if torch.is_tensor(t) and t.is_floating_point()
        ]
        if ins and outs:
            i, o = max(float(t.abs().max()) for t in ins), max(float(t.abs().max()) for t in outs)
            if i < 65504 < o:
                found.append(f"from {names[module] or '<root>'}")
            if o < 65504 < i:
                found.append(f"to {names[module] or '<root>'}")

    handles = [m.register_forward_hook(check) for m in model.modules()]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return ", ".join(found[:2]) if found else "nothing"


def by_debug_underflow_overflow(model, inputs) -> str:
    try:
        from transformers.debug_utils import DebugUnderflowOverflow
    except ImportError as exc:
        return f"not installed ({exc.name})"
    half = copy.deepcopy(model).half()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        DebugUnderflowOverflow(half, max_frames_to_save=1)
        try:
            with torch.no_grad():
                half(*[t.half() if t.is_floating_point() else t for t in inputs])
        except ValueError as exc:
            if "DebugUnderflowOverflow" not in str(exc):
                raise
            text = buf.getvalue()
            headers = re.findall(r"^\s+(\S+) (\w+)$", text, flags=re.M)
            return f"inf/NaN at {headers[-1][0]}" if headers else "inf/NaN (site not named)"
    return "nothing"


def finding_table() -> list[dict]:
    rows = []
    for problem, (name, mechanism) in CASES.items():
        model, inputs = models.WATCH_CASES[name]()
        rows.append(
            {
                "problem": problem,
                "real FP16": truth(name, model, inputs),
                "fp16lens": by_fp16lens(model, inputs, mechanism),
                "seed hooks": by_seed_hooks(model, inputs),
                "DebugUnderflowOverflow": by_debug_underflow_overflow(model, inputs),
            }
        )
    return rows


def overhead_table(quick: bool) -> list[dict]:
    rows = []
    for name in bench_watch.MODELS:
        model, inputs = bench_watch.MODELS[name](quick)
        methods = [m for m in bench_watch.METHODS if bench_watch.available(m) is None]
        ratios = bench_watch.time_ratios(model, inputs, methods, 3 if quick else 7)
        rows.append(
            {
                "model": name,
                **{m: f"{ratios[m]:.2f}x" if m in ratios else "-" for m in bench_watch.METHODS},
            }
        )
    return rows


def _print(title: str, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col)
    for r in rows:
        table.add_row(*[escape(str(v)) for v in r.values()])
    Console(width=180).print(table)


TABLES = ("finding", "overhead", "fixing", "exactness")
TITLES = {
    "finding": "Finding: which tool finds which problem, and where",
    "overhead": "Overhead: time of one forward / plain forward ({mode} mode)",
    "fixing": "Fixing: FP16 share of Conv/Gemm/MatMul FLOPs, onnx-fp16 parity, added nodes ({mode} mode)",
    "exactness": "Exactness: FP32 error of the fold vs the seed's runtime forms (max|err|/max|truth|)",
}


def run_tables(tables, quick: bool, models_=None) -> dict[str, list[dict]]:
    """The requested tables' rows, in TABLES order."""
    makers = {
        "finding": finding_table,
        "overhead": lambda: overhead_table(quick),
        "fixing": lambda: fixing_rows(models_, quick=quick),
        "exactness": exactness_rows,
    }
    return {t: makers[t]() for t in TABLES if t in tables}


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced mode for CI")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--tables", default=",".join(TABLES), help=f"comma list of {', '.join(TABLES)}"
    )
    parser.add_argument("--models", default=None, help="comma list of Fixing-table models")
    parser.add_argument(
        "--markdown",
        default=None,
        help="write the 'Compared with' section of docs/benchmarks.md here",
    )
    args = parser.parse_args(argv)
    unknown = set(_csv(args.tables)) - set(TABLES)
    if unknown:
        parser.error(f"unknown table(s) {sorted(unknown)}; choose from {', '.join(TABLES)}")
    models_ = _csv(args.models) if args.models else None
    result = run_tables(_csv(args.tables), args.quick, models_)
    mode = "quick" if args.quick else "full"
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(compared_with(result, mode, argv if argv is not None else sys.argv[1:]))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, rows in result.items():
            _print(TITLES[name].format(mode=mode), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
