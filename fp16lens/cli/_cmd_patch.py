"""`fp16lens patch MODEL --report report.json -o patched.pt`: print the fix plan,
apply it, and save the patched model (.pt TorchScript or .pt2 torch.export program; an
ONNX MODEL is saved as ONNX: `fp16lens patch model.onnx --report r.json -o fixed.onnx`).
With --input (a .pt/.npz/.npy file of the user's batches, or shapes) the patched model is proven
in real FP16 on those inputs and the fix widened until it passes; without it, a warning
says the FP16 check did not run. Exit 1 when anything is left unresolved."""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from pathlib import Path

from rich.markup import escape

from fp16lens._core import Fp16LensError
from fp16lens._core.onnx_types import is_onnx
from fp16lens._core.options import given
from fp16lens._core.paths import check_save_path, check_writable
from fp16lens._core.sites import site_module
from fp16lens.cli._inputargs import (
    add_input_arguments,
    add_model_arguments,
    batches_from_args,
    onnx_batches,
)
from fp16lens.cli._models import load_model, parse_kwargs
from fp16lens.cli._output import console, emit_json
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
        help="patched model file: .pt2 (torch.export program) or .pt (TorchScript); .onnx for an ONNX MODEL",
    )
    p.add_argument("--factor", type=float, default=None, help="rescaling factor (a power of two)")
    p.add_argument(
        "--max-rel",
        type=float,
        default=None,
        metavar="R",
        help="with --input, also at most this largest |FP16 - FP32| relative to the output's "
        "largest value",
    )
    p.add_argument(
        "--min-cosine",
        type=float,
        default=None,
        metavar="C",
        help="the proof's parity tolerance with --input: each output's cosine against FP32 "
        "(default 0.999)",
    )
    add_input_arguments(p, batches=False)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if is_onnx(args.model):
        return run_onnx(args)
    from fp16lens.patch import PatchWarning, get_plan, save
    from fp16lens.patch import patch as patch_fn

    check_save_path(args.output)
    report = Report.load(args.report)
    loaded = load_model(args.model, parse_kwargs(args.kwargs))
    default = loaded.example_inputs or _from_report(report)
    batches = batches_from_args(args, None, loaded.model) if args.input else None
    example = batches[0] if batches else batches_from_args(args, default, loaded.model)[0]
    with warnings.catch_warnings():  # the CLI prints what the warnings say (finish_lines)
        warnings.simplefilter("ignore", PatchWarning)
        patched = patch_fn(
            loaded.model,
            report,
            inplace=False,
            factor=args.factor,
            batches=batches,
            **given(min_cosine=args.min_cosine, max_rel=args.max_rel),
        )
    plan = get_plan(patched)  # what patch() did, unresolved problems included
    assert plan is not None  # patch() attaches its plan to the model it returns
    saved = save(patched, example, args.output)
    left = unfixed(plan, patched)
    islands = fp32_modules(plan, left)
    if args.json:
        emit_json(
            {
                "output": str(saved),
                "fixed": not left,
                "unfixed": left,
                "fp32_modules": islands,
                "proven": plan.proven,
                "plan": to_plain(plan),
            }
        )
        return 1 if left else 0
    con = console()
    con.print(terminal_plan(plan))
    con.print(f"patched model saved to {escape(str(saved))}")
    for line in finish_lines(left, islands, saved, plan.proven):
        con.print(line, markup=False, highlight=False)
    for line in _unchecked(plan):
        con.print(f"warning: {line}", markup=False, highlight=False)
    return 1 if left else 0


def run_onnx(args: argparse.Namespace) -> int:
    """An ONNX MODEL patched as a graph, proven in FP16 on --input (else the FP32 check on
    inputs like the report's recorded ones); its FP32 islands named in the file's metadata."""
    from fp16lens.patch import PatchOptions
    from fp16lens.patch.onnx import patch_onnx

    options = PatchOptions(
        **given(factor=args.factor, min_cosine=args.min_cosine, max_rel=args.max_rel)
    )
    if not args.output.lower().endswith(".onnx"):
        raise Fp16LensError(
            f"an ONNX MODEL is saved as ONNX: give -o with a .onnx name, not {args.output!r}"
        )
    out = check_writable(Path(args.output))
    report = Report.load(args.report)
    out.parent.mkdir(parents=True, exist_ok=True)
    batches = onnx_batches(args) if args.input else None  # the FP32 check's inputs
    _, plan = patch_onnx(args.model, report, options, out=out, batches=batches)
    left_notes = _unchecked(plan)
    left = [{"site": u.site, "reason": u.reason, "module": u.site} for u in plan.unresolved]
    if args.json:
        emit_json(
            {
                "output": str(out),
                "fixed": not left,
                "unfixed": left,
                "fp32_nodes": plan.fp32_modules,
                "proven": plan.proven,
                "plan": to_plain(plan),
            }
        )
        return 1 if left else 0
    con = console()
    con.print(terminal_plan(plan))
    con.print(f"patched model saved to {escape(str(out))}")
    for line in not_fixed_lines(left, plan.proven):
        con.print(line, markup=False, highlight=False)
    if plan.fp32_modules:
        con.print(
            f"FP32 nodes (metadata fp16lens.fp32_nodes, read by the FP16 export): "
            f"{', '.join(plan.fp32_modules)}",
            markup=False,
            highlight=False,
        )
    for line in left_notes:
        con.print(f"warning: {line}", markup=False, highlight=False)
    return 1 if left else 0


def _unchecked(plan) -> list[str]:
    """The plan's notes saying a check did not run (the FP32 check, real FP16), or that the
    whole model was kept FP32 for precision alone (with the tolerance that keeps FP16)."""
    from fp16lens.patch import PRECISION_NOTE

    return [
        cli_words(n)
        for n in getattr(plan, "notes", [])
        if n.startswith(
            ("FP32 equivalence not checked", "the FP16 check did not run", PRECISION_NOTE)
        )
    ]


def cli_words(text: str) -> str:
    """A library message as a terminal user acts on it: ``patch(..., min_cosine=0.998)``
    becomes ``--min-cosine 0.998``."""
    return re.sub(
        r"patch\(\.\.\., ([^)]*)\)",
        lambda m: re.sub(
            r"(\w+)=", lambda k: "--" + k.group(1).replace("_", "-") + " ", m.group(1)
        ).replace(",", ""),
        text,
    )


def terminal_plan(plan):
    """The plan as the terminal prints it: its notes and reasons in flags (cli_words); not
    the note on saving from Python (the command has saved the file that keeps the fix)."""
    from fp16lens.patch import STATE_DICT_NOTE

    return dataclasses.replace(
        plan,
        notes=[cli_words(n) for n in plan.notes if not n.startswith(STATE_DICT_NOTE)],
        unresolved=[dataclasses.replace(u, reason=cli_words(u.reason)) for u in plan.unresolved],
        widened=[dataclasses.replace(w, reason=cli_words(w.reason)) for w in plan.widened],
    )


def unfixed(plan, model) -> list[dict]:
    """What the patch left out of FP16 range: each unresolved site, its reason, and the
    module to keep in FP32 for it (None for a functional op of the model's own forward)."""
    names = {n for n, _ in model.named_modules() if n}
    left = []
    for u in getattr(plan, "unresolved", None) or []:
        module = site_module(u.site)  # a functional op runs in its owner's forward
        left.append(
            {"site": u.site, "reason": u.reason, "module": module if module in names else None}
        )
    return left


def fp32_modules(plan, left: list[dict]) -> list[str]:
    """The plan's FP32 islands, then the modules that finish what the patch left."""
    modules = list(getattr(plan, "fp32_modules", None) or [])
    return list(dict.fromkeys(modules + [u["module"] for u in left if u["module"]]))


def not_fixed_lines(left: list[dict], proven: bool) -> list[str]:
    """What the patch left out of FP16 range, each with its reason in CLI words; where real
    FP16 still passed on the given inputs, that is said too (plain text, no markup)."""
    if not left:
        return []
    passed = (
        " (real FP16 passed on the --input batches, so there they did no harm; other "
        "inputs may differ)"
        if proven
        else ""
    )
    head = f"NOT FIXED: {len(left)} problem(s) stay out of FP16 range after the patch{passed}:"
    return [head, *(f"  {u['site']}: {cli_words(u['reason'])}" for u in left)]


def finish_lines(left: list[dict], islands: list[str], saved, proven: bool) -> list[str]:
    """The exact export options that finish the job (plain text, no markup)."""
    lines = not_fixed_lines(left, proven)
    if islands == [""]:
        lines.append(
            f"the whole model is kept FP32: fp16lens export {saved} -o model.onnx keeps it FP32"
        )
    elif islands:
        names = ",".join(islands)
        quoted = ", ".join(repr(m) for m in islands)
        lines.append(f"export it with: fp16lens export {saved} -o model.onnx")
        lines.append(
            f"  (the file names its FP32 islands {names}, and export keeps them FP32; "
            f"for another export of the model: --fp32-modules {names})"
        )
        lines.append(
            f"  (Python: fp16lens.export(patched, x, path) keeps them too; "
            f"fp32_modules=[{quoted}] for the unpatched model)"
        )
    from fp16lens.patch import PROOF_SITE

    opaque = [u["site"] for u in left if not u["module"] and u["site"] != PROOF_SITE]
    if opaque:
        lines.append(
            f"no module holds {', '.join(opaque)}: move that op into its own nn.Module, then "
            "scan and patch again (it becomes an FP32 island)"
        )
    return lines


def _from_report(report: Report) -> tuple | None:
    """Random float32 inputs shaped like the report's first batch: enough to trace for saving."""
    import torch

    shapes = report.meta.input_shapes
    if not shapes:
        return None
    return tuple(torch.rand(shape) for shape in shapes[0])
