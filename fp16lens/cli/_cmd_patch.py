"""`fp16lens patch MODEL --report report.json -o patched.pt`: print the fix plan,
apply it, and save the patched model (.pt TorchScript or .pt2 torch.export program)."""

from __future__ import annotations

import argparse

from fp16lens.cli._cmd_scan import add_model_arguments
from fp16lens.cli._inputargs import add_input_arguments, batches_from_args
from fp16lens.cli._models import load_model, parse_kwargs
from fp16lens.cli._output import console, emit_json
from fp16lens.cli._save import check_save_path, save_model
from fp16lens.cli._stages import stage
from fp16lens.cli._summary import to_plain
from fp16lens.report import Report


def add_parser(sub) -> None:
    p = sub.add_parser("patch", help="rescale MODEL so FP16 holds its values", description=__doc__)
    add_model_arguments(p)
    p.add_argument("--report", required=True, help="the report of `fp16lens scan --save`")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="patched model file: .pt2 (torch.export program) or .pt (TorchScript)",
    )
    p.add_argument("--factor", type=float, default=None, help="rescaling factor (a power of two)")
    add_input_arguments(p, batches=False)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan_fn = stage("fp16lens.patch", "plan", "patch")
    patch_fn = stage("fp16lens.patch", "patch", "patch")
    check_save_path(args.output)
    report = Report.load(args.report)
    loaded = load_model(args.model, parse_kwargs(args.kwargs))
    example = batches_from_args(args, loaded.example_inputs or _from_report(report))[0]
    plan = plan_fn(loaded.model, report)
    patched = patch_fn(loaded.model, report, inplace=False, factor=args.factor)
    saved = save_model(patched, example, args.output)
    islands = list(getattr(plan, "fp32_modules", None) or [])
    if args.json:
        emit_json({"output": str(saved), "fp32_modules": islands, "plan": to_plain(plan)})
        return 0
    con = console()
    con.print(plan)
    con.print(f"patched model saved to {saved}")
    if islands:
        con.print(f"export it with: --fp32-modules {','.join(islands)}")
    return 0


def _from_report(report: Report) -> tuple | None:
    """Random float32 inputs shaped like the report's first batch: enough to trace for saving."""
    import torch

    shapes = report.meta.input_shapes
    if not shapes:
        return None
    return tuple(torch.rand(shape) for shape in shapes[0])
