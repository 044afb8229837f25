"""`fp16lens scan MODEL --input SPEC`: watch MODEL on inputs, print/save the report,
and fail a CI gate (exit 1) when `--fail-on` forbids what was found."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from fp16lens._core import ReportError, import_optional
from fp16lens._core.onnx_types import is_onnx
from fp16lens._core.paths import check_writable
from fp16lens.cli._cmd_show import print_report
from fp16lens.cli._inputargs import (
    add_input_arguments,
    add_model_arguments,
    batches_from_args,
    onnx_batches,
)
from fp16lens.cli._models import load_model, parse_kwargs
from fp16lens.cli._output import console, emit_json
from fp16lens.cli._policy import POLICIES, POLICY_HELP, violations
from fp16lens.cli._summary import report_summary
from fp16lens.report import Report


def add_parser(sub) -> None:
    p = sub.add_parser("scan", help="find where values leave the FP16 range", description=__doc__)
    add_model_arguments(p)
    add_input_arguments(p)
    p.add_argument(
        "--save",
        metavar="PATH",
        action="append",
        help="save the report (.json, .html, .svg or .txt) or its plot (.png or "
        ".pdf, needs matplotlib); repeatable",
    )
    p.add_argument("--fail-on", action="append", choices=POLICIES, help=POLICY_HELP)
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="overflow limit, at most 65504 (the default): a lower one keeps a margin",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--compile",
        action="store_true",
        help="long scans: record through one graph per input shape compiled with "
        "torch.compile/Inductor (first batch eager; eager with a note where "
        "the model cannot be captured)",
    )
    p.set_defaults(run=run)


REPORT_SUFFIXES = (".json", ".html", ".svg", ".txt")
PLOT_SUFFIXES = (".png", ".pdf")  # report.plot(path): matplotlib (the plot extra)


def save_report(report: Report, path: str) -> None:
    """The report, or its plot for a picture suffix."""
    if Path(path).suffix.lower() in PLOT_SUFFIXES:
        report.plot(path)
    else:
        report.save(path)


def run(args: argparse.Namespace) -> int:
    from fp16lens.watch import ScanInterrupted

    for path in args.save or []:
        check_report_path(path)
    options = {} if args.threshold is None else {"threshold": args.threshold}
    try:
        if is_onnx(args.model):
            report = _scan_onnx(args, options)
        else:
            loaded = load_model(args.model, parse_kwargs(args.kwargs))
            batches = batches_from_args(args, loaded.example_inputs, loaded.model)
            report = watch_batches(
                loaded.model, batches, not args.no_progress, compile=args.compile, **options
            )
    except ScanInterrupted as stop:
        return _save_partial(stop, args)
    for path in args.save or []:
        save_report(report, path)
    failed = violations(report, args.fail_on)
    if args.json:
        summary = report_summary(report)
        saved = args.save or []
        emit_json(
            {
                **summary,
                "saved": saved[0] if saved else None,
                "saved_all": saved,
                "fail_on": args.fail_on or [],
                "failed": failed,
            }
        )
    else:
        saved = [p for p in args.save or [] if Path(p).suffix.lower() not in PLOT_SUFFIXES]
        print_report(report, saved=saved[0] if saved else None)
        _print_gate(failed, args)
    return 1 if failed else 0


def _scan_onnx(args: argparse.Namespace, options: dict) -> Report:
    """An .onnx MODEL in ONNX Runtime; one .npz --input is matched to the graph's inputs
    by array name (``numpy.savez(path, x=array)``), else by position."""
    from fp16lens.watch import scan

    if args.kwargs:
        raise ReportError("--kwargs applies to a module:callable MODEL, not to an .onnx file")
    if args.compile:
        raise ReportError(
            "--compile applies to a torch MODEL; an .onnx file runs in ONNX Runtime "
            "(leave --compile out)"
        )
    return scan(args.model, onnx_batches(args), progress=not args.no_progress, **options)


def check_report_path(path: str) -> None:
    """Before the watch: a suffix report.save() understands, in a place that can be written."""
    suffix = Path(path).suffix.lower()
    if suffix not in REPORT_SUFFIXES + PLOT_SUFFIXES:
        raise ReportError(
            f"cannot save a report as {suffix or 'a file without suffix'!r}; "
            f"use {', '.join(REPORT_SUFFIXES + PLOT_SUFFIXES)}"
        )
    if suffix in PLOT_SUFFIXES:  # before the watch, not after it
        import_optional("matplotlib", "plot", f"--save {path}")
    check_writable(path)


def watch_batches(model, batches: Sequence, progress: bool = True, **options) -> Report:
    """The scan loop (``fp16lens.watch.scan``) over the batches; Ctrl-C is a ScanInterrupted
    holding the report of what ran."""
    from fp16lens.watch import scan

    return scan(model, batches, progress=progress, **options)


def _save_partial(stop, args: argparse.Namespace) -> int:
    """Ctrl-C: the report of the batches done so far is saved when --save asked for one."""
    import sys

    where = "nothing saved (add --save PATH to keep a partial report)"
    if args.save:
        for path in args.save:
            save_report(stop.report, path)
        where = f"the report of what ran is saved to {', '.join(args.save)}"
    print(
        f"fp16lens: interrupted during batch {stop.done + 1} of {stop.total} "
        f"({stop.done} ran whole); {where}",
        file=sys.stderr,
    )
    return 130


def _print_gate(failed: list[str], args: argparse.Namespace) -> None:
    con = console()
    for path in args.save or []:
        con.print(f"report saved to {path}")
    if failed:
        con.print(f"[bold red]--fail-on {','.join(args.fail_on)}: {len(failed)} violation(s)")
        for line in failed:
            con.print(f"  {line}")
