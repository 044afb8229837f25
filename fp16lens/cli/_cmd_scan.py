"""`fp16lens scan MODEL --input SPEC`: watch MODEL on inputs, print/save the report,
and fail a CI gate (exit 1) when `--fail-on` forbids what was found."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp16lens._core import ReportError, import_optional
from fp16lens._core.paths import check_writable
from fp16lens.cli._cmd_show import print_report
from fp16lens.cli._inputargs import add_input_arguments, batches_from_args
from fp16lens.cli._models import MODEL_HELP, is_onnx_file, load_model, parse_kwargs
from fp16lens.cli._output import console, emit_json, err_console
from fp16lens.cli._policy import POLICIES, POLICY_HELP, violations
from fp16lens.cli._stages import stage
from fp16lens.cli._summary import report_summary
from fp16lens.report import Report


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--kwargs", default=None, help="JSON keyword arguments for a MODEL callable")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the traceback of an error, and let torch's and ONNX Runtime's own warnings "
        "and log output through",
    )


def add_parser(sub) -> None:
    p = sub.add_parser("scan", help="find where values leave the FP16 range", description=__doc__)
    add_model_arguments(p)
    add_input_arguments(p)
    p.add_argument("--save", metavar="PATH", action="append",
                   help="save the report (.json, .html, .svg or .txt) or its plot (.png or "
                        ".pdf, needs matplotlib); repeatable")
    p.add_argument("--fail-on", action="append", choices=POLICIES, help=POLICY_HELP)
    p.add_argument("--threshold", type=float, default=None,
                   help="overflow limit, at most 65504 (the default): a lower one keeps a margin")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--compile", action="store_true",
                   help="long scans: record through one graph per input shape compiled with "
                        "torch.compile/Inductor (first batch eager; eager with a note where "
                        "the model cannot be captured)")
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
    for path in args.save or []:
        check_report_path(path)
    options = {} if args.threshold is None else {"threshold": args.threshold}
    if is_onnx_file(args.model):
        report = _scan_onnx(args, options)
    else:
        loaded = load_model(args.model, parse_kwargs(args.kwargs))
        batches = batches_from_args(args, loaded.example_inputs, loaded.model)
        if args.compile:
            scan = stage("fp16lens.watch", "scan", "scan")
            report = scan(loaded.model, batches, progress=not args.no_progress and len(batches) > 1,
                          compile=True, **options)
        else:
            try:
                report = watch_batches(loaded.model, batches, not args.no_progress, **options)
            except ScanInterrupted as stop:
                return _save_partial(stop, args)
    for path in args.save or []:
        save_report(report, path)
    failed = violations(report, args.fail_on)
    if args.json:
        summary = report_summary(report)
        saved = args.save or []
        emit_json({**summary, "saved": saved[0] if saved else None, "saved_all": saved,
                   "fail_on": args.fail_on or [], "failed": failed})
    else:
        print_report(report)
        _print_gate(failed, args)
    return 1 if failed else 0


def _scan_onnx(args: argparse.Namespace, options: dict) -> Report:
    """An .onnx MODEL in ONNX Runtime; one .npz --input is matched to the graph's inputs
    by array name (``numpy.savez(path, x=array)``), else by position."""
    scan = stage("fp16lens.watch", "scan", "scan")
    if args.kwargs:
        raise ReportError("--kwargs applies to a module:callable MODEL, not to an .onnx file")
    if args.compile:
        raise ReportError("--compile applies to a torch MODEL; an .onnx file runs in ONNX Runtime "
                          "(leave --compile out)")
    return scan(args.model, onnx_batches(args), progress=not args.no_progress, **options)


def onnx_batches(args: argparse.Namespace) -> list:
    """The --input batches for an .onnx MODEL (scan, and patch's FP32 check)."""
    import numpy as np

    specs = args.input or []
    if len(specs) == 1 and specs[0].lower().endswith(".npz") and args.batch_size is None:
        batch = _npz_batch(Path(specs[0]), np)
        wanted = _graph_inputs(args.model)
        if isinstance(batch, dict) and wanted and set(batch) != set(wanted) and len(batch) == len(wanted):
            return [tuple(batch.values())]  # names that are not the graph's: by position
        return [batch]
    return batches_from_args(args, None)


def _graph_inputs(path: str) -> list[str]:
    """The names of an ONNX file's graph inputs (initializers excluded); [] if unreadable."""
    try:
        import onnx

        graph = onnx.load(path, load_external_data=False).graph
    except Exception:  # the scan itself says what is wrong with the file
        return []
    init = {i.name for i in graph.initializer}
    return [i.name for i in graph.input if i.name not in init]


def _npz_batch(path: Path, np) -> dict | tuple:
    from fp16lens.cli._batchfile import load_batches

    with np.load(path) as data:
        named = {k: data[k] for k in data.files}
    if all(k.startswith("arr_") for k in named):  # numpy.savez(path, a, b): positional
        return load_batches(path)[0]
    return named


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


def watch_batches(model, batches: list, progress: bool = True, **options) -> Report:
    """watch() over every batch, with a progress bar on stderr when there are several."""
    import torch

    from fp16lens._core.progress import progress_bar as make_bar

    watch = stage("fp16lens.watch", "watch", "scan")
    call_model = stage("fp16lens.watch", "call_model", "scan")
    bar = make_bar(err_console(), disable=not progress or len(batches) < 2)
    done = 0
    with watch(model, **options) as lens, torch.no_grad(), bar:
        task = bar.add_task("watching", total=len(batches))
        try:
            for batch in batches:
                call_model(model, batch)
                done += 1
                bar.advance(task)
        except KeyboardInterrupt:  # the report holds what ran, the batch cut short included
            interrupted = ScanInterrupted(done, len(batches))
        else:
            interrupted = None
    if interrupted is not None:
        interrupted.report = lens.report
        raise interrupted
    return lens.report


class ScanInterrupted(KeyboardInterrupt):
    """Ctrl-C after ``done`` whole batches: ``report`` holds what ran (the statistics of the
    batch cut short up to the interrupt included, as watch keeps those of a forward that
    raises)."""

    def __init__(self, done: int, total: int):
        super().__init__(f"interrupted after {done} of {total} batches")
        self.done, self.total = done, total
        self.report: Report | None = None


def _save_partial(stop: ScanInterrupted, args: argparse.Namespace) -> int:
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
