"""`fp16lens show report.json [--full] [--json] [--save PATH]`: print a saved report, or
render it again (.html, .svg, .txt, or its plot as .png or .pdf)."""

from __future__ import annotations

import argparse
import shlex

from rich.markup import escape

from fp16lens.cli._output import console, emit_json
from fp16lens.cli._summary import report_summary
from fp16lens.report import Report


def add_parser(sub) -> None:
    p = sub.add_parser("show", help="print a saved report (.json)", description=__doc__)
    p.add_argument("report", help="a report saved by `fp16lens scan --save` or report.save()")
    p.add_argument("--full", action="store_true", help="every site, not only the problems")
    p.add_argument(
        "--save",
        metavar="PATH",
        action="append",
        help="render the report to PATH (.json, .html, .svg or .txt) or its plot (.png or "
        ".pdf, needs matplotlib) instead of printing it; repeatable",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fp16lens.cli._cmd_scan import check_report_path, save_report

    for path in args.save or []:
        check_report_path(path)
    report = Report.load(args.report)
    if args.save:
        for path in args.save:
            save_report(report, path)
            console().print(f"report saved to {escape(path)}")
        return 0
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
