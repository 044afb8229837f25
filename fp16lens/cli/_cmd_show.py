"""`fp16lens show report.json [--full] [--json]`: print a saved report."""

from __future__ import annotations

import argparse
import shlex

from fp16lens.cli._output import console, emit_json
from fp16lens.cli._summary import report_summary
from fp16lens.report import Report


def add_parser(sub) -> None:
    p = sub.add_parser("show", help="print a saved report (.json)", description=__doc__)
    p.add_argument("report", help="a report saved by `fp16lens scan --save` or report.save()")
    p.add_argument("--full", action="store_true", help="every site, not only the problems")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = Report.load(args.report)
    if args.json:
        emit_json(report_summary(report, full=args.full))
    else:
        print_report(report, full=args.full, saved=args.report)
    return 0


def print_report(report: Report, full: bool = False, saved: str | None = None) -> None:
    """The report's rich rendering on stdout (`full`: every site); what it hides is shown by
    `fp16lens show` of the ``saved`` file with --full."""
    hint = (
        f"fp16lens show {shlex.quote(saved)} --full shows all"
        if saved
        else "scan with --save report.json, then fp16lens show report.json --full shows all"
    )
    report.print(full=full, console=console(), full_hint=hint)
