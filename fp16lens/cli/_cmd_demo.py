"""`fp16lens demo [--out DIR] [--json]`: the whole journey on the built-in text detector
(no download): find the overflow, plan and apply the fix, prove parity, export ONNX."""

from __future__ import annotations

import argparse

from fp16lens.cli._output import console, emit_json


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="the whole journey on a built-in model", description=__doc__)
    p.add_argument("--out", default="fp16lens-demo", help="output folder (default ./fp16lens-demo)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fp16lens.demo import run_demo

    summary = run_demo(args.out, console(quiet=args.json))
    if args.json:
        emit_json(summary)
    return 0 if summary.get("fixed") else 1
