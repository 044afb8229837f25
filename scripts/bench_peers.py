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

    python scripts/bench_peers.py            # full
    python scripts/bench_peers.py --quick    # reduced (CI)
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
        return "bn.running_var inf in FP16" if torch.isinf(model.bn.running_var.half()).any() else "none"
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
        return f"{f.mechanism} {f.kind} at {f.site}" + (f".{f.tensor}" if f.mechanism == "parameter" else "")
    other = [f for f in r.findings if f.mechanism != "note"] + r.spans
    return "nothing" if not other else f"other: {len(other)} items"


def by_seed_hooks(model, inputs) -> str:
    names = {m: n for n, m in model.named_modules()}
    found: list[str] = []

    def check(module, args, output):
        ins = [t for t in torch.utils._pytree.tree_flatten(args)[0] if torch.is_tensor(t) and t.is_floating_point()]
        outs = [t for t in torch.utils._pytree.tree_flatten(output)[0] if torch.is_tensor(t) and t.is_floating_point()]
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
        rows.append({
            "problem": problem,
            "real FP16": truth(name, model, inputs),
            "fp16lens": by_fp16lens(model, inputs, mechanism),
            "seed hooks": by_seed_hooks(model, inputs),
            "DebugUnderflowOverflow": by_debug_underflow_overflow(model, inputs),
        })
    return rows


def overhead_table(quick: bool) -> list[dict]:
    rows = []
    for name in bench_watch.MODELS:
        model, inputs = bench_watch.MODELS[name](quick)
        methods = [m for m in bench_watch.METHODS if bench_watch.available(m) is None]
        ratios = bench_watch.time_ratios(model, inputs, methods, 3 if quick else 7)
        rows.append({"model": name, **{m: f"{ratios[m]:.2f}x" if m in ratios else "-" for m in bench_watch.METHODS}})
    return rows


def _print(title: str, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col)
    for r in rows:
        table.add_row(*[str(v) for v in r.values()])
    Console(width=180).print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced mode for CI")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = {"finding": finding_table(), "overhead": overhead_table(args.quick)}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print("Finding: which tool finds which problem, and where", result["finding"])
        _print(f"Overhead: time of one forward / plain forward ({'quick' if args.quick else 'full'} mode)",
               result["overhead"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
