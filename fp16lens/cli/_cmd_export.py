"""`fp16lens export MODEL -o model.onnx --precision fp16|int8|fp32 --input SPEC`:
write a typed ONNX file (strongly typed FP16, or INT8 Q/DQ calibrated on the inputs).
MODEL may be an FP32 .onnx file (a patched one keeps its FP32 islands); --input then
serves only the INT8 calibration."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from rich.markup import escape

from fp16lens._core import Fp16LensError
from fp16lens._core.onnx_types import is_onnx
from fp16lens._core.paths import check_writable
from fp16lens._core.quiet import verbose
from fp16lens.cli._batchfile import load_batches
from fp16lens.cli._inputargs import (
    add_input_arguments,
    add_model_arguments,
    batches_from_args,
    graph_npz,
    onnx_batches,
)
from fp16lens.cli._models import load_model, parse_kwargs
from fp16lens.cli._output import console, emit_json
from fp16lens.cli._target import parse_target


def _share(text: str) -> float:
    """``--max-fallback``: a share of the FLOPs, 0.25 or 25%."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:  # nan fails too
        raise argparse.ArgumentTypeError(
            f"give the share of the FLOPs that may leave INT8, in [0, 1] or as a percentage "
            f"(0.25 or 25%), not {text!r}"
        )
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write FP16 / INT8 ONNX", description=__doc__)
    add_model_arguments(p)
    p.add_argument("-o", "--output", required=True, help="the ONNX file to write")
    p.add_argument("--precision", choices=("fp16", "int8", "fp32"), default="fp16")
    p.add_argument(
        "--dynamic",
        metavar="AXES",
        default="",
        help="symbolic axes of the graph: batch (dimension 0 of every input and "
        "output) and/or sequence (dimension 1 of inputs of rank 2-3), e.g. "
        "--dynamic batch,sequence",
    )
    p.add_argument(
        "--io-dtype",
        choices=("fp32", "fp16"),
        default="fp32",
        help="dtype of the graph's float inputs and outputs in an FP16 export "
        "(default fp32: Casts at the boundary; fp16: the caller feeds half tensors)",
    )
    p.add_argument(
        "--calibration",
        metavar="FILE",
        default=None,
        help="INT8 calibration batches (.pt/.npz/.npy); default: the --input batches. With "
        "both, an --input file holds the evaluation batches, held out: the INT8 file is "
        "checked on them (and --target holds there)",
    )
    p.add_argument(
        "--target",
        type=parse_target,
        default=None,
        metavar="TARGET",
        help="INT8 parity target on the evaluation batches (an --input file beside "
        "--calibration; else the calibration batches): the worst output cosine to FP32 "
        "(0.999), or NAME=VALUE: cosine, mean-cosine, sqnr (worst, dB: sqnr=30), top1 or ctc "
        "(the share of FP32's top-1 or greedy-CTC decision margin kept, output 0: "
        "top1=0.9), or your metric FILE.py:FUNC=VALUE, FUNC(refs, outs) -> float on the "
        "FP32 and INT8 outputs per batch; the costliest layers leave INT8 until it holds, "
        "else the export fails",
    )
    p.add_argument(
        "--max-fallback",
        type=_share,
        default=None,
        metavar="SHARE",
        help="with --target: the share of the conv/gemm/matmul FLOPs that may leave INT8 "
        "(default 0.1; 0.25 or 25%%)",
    )
    p.add_argument(
        "--float-parts",
        choices=("fp32", "fp16"),
        default="fp32",
        help="with --precision int8: the type of every tensor that is not INT8 in the file "
        "(fp16: typed FP16, opset 19, for FP16 beside INT8 in a strongly typed TensorRT "
        "build; checked like the file, and --target's fallback holds it there too)",
    )
    p.add_argument(
        "--fp32-modules",
        default=None,
        metavar="A,B",
        help="modules kept in FP32 in an FP16 export (the islands `fp16lens patch` printed)",
    )
    p.add_argument(
        "--fp32-nodes",
        default=None,
        metavar="A,B",
        help="for an .onnx MODEL: node names kept in FP32, beside those a patched file records",
    )
    p.add_argument(
        "--exporter",
        choices=("auto", "dynamo", "torchscript"),
        default="auto",
        help="torch's ONNX exporter (auto: dynamo, falling back to TorchScript)",
    )
    add_input_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(run=run)


def _names(text: str | None) -> list[str]:
    return [m for m in (text or "").split(",") if m]


def run(args: argparse.Namespace) -> int:
    from fp16lens.export import export

    if Path(args.output).suffix.lower() != ".onnx":
        raise Fp16LensError(
            f"-o {args.output}: export writes an ONNX file; name it with the .onnx suffix "
            "(build a TensorRT engine from it with fp16lens.export.build_engine)"
        )
    if args.target is not None and args.precision != "int8":
        raise Fp16LensError("--target is the INT8 parity target; give --precision int8 with it")
    if args.float_parts != "fp32" and args.precision != "int8":
        raise Fp16LensError(
            "--float-parts types the float parts of an INT8 file; give --precision int8 with "
            "it (--precision fp16 types the whole graph FP16)"
        )
    if args.max_fallback is not None and args.target is None:
        raise Fp16LensError(
            "--max-fallback is the share of the FLOPs that --target's fallback may keep out of "
            "INT8; give --target too (e.g. --target 0.999)"
        )
    check_writable(args.output)
    if args.target is not None:  # a user's metric file is imported here, not when parsed
        args.target = args.target.resolve()
    try:
        artifact = (_export_onnx if is_onnx(args.model) else _export_torch)(export, args)
    except Fp16LensError as exc:  # the library's advice in the words a terminal user types
        words = terminal_words(str(exc))
        if words == str(exc):
            raise
        raise Fp16LensError(words) from exc
    _say_generated_calibration(args)
    return _print(artifact, args)


def _export_torch(export, args: argparse.Namespace):
    if args.fp32_nodes:
        raise Fp16LensError("--fp32-nodes names nodes of an .onnx MODEL; use --fp32-modules")
    loaded = load_model(args.model, parse_kwargs(args.kwargs))
    batches = batches_from_args(args, loaded.example_inputs, loaded.model)
    calibration = evaluation = None
    if args.precision == "int8":
        calibration = load_batches(args.calibration) if args.calibration else batches
        evaluation = batches if args.calibration and _input_file(args) else None
    _say_fixed_batch(args, batches)
    # the islands a file saved by `fp16lens patch` names stay FP32 without being asked for
    islands = list(dict.fromkeys([*loaded.fp32_modules, *_names(args.fp32_modules)]))
    with verbose(args.verbose):
        return export(
            loaded.model,
            batches[0],
            args.output,
            precision=args.precision,
            calibration=calibration,
            evaluation=evaluation,
            target=args.target,
            max_fallback=args.max_fallback,
            float_parts=args.float_parts,
            fp32_modules=islands or None,
            io_dtype=args.io_dtype,
            exporter=args.exporter,
            dynamic=_names(args.dynamic),
        )


def _input_file(args: argparse.Namespace) -> bool:
    """Whether --input names a file of batches (real inputs), not shapes."""
    from fp16lens.cli._inputs import is_file_spec

    return bool(args.input) and len(args.input) == 1 and is_file_spec(args.input[0])


def _say_generated_calibration(args: argparse.Namespace) -> None:
    """A note on stderr where INT8 is calibrated on inputs generated from shapes: its
    ranges fit random values, not the model's data, and its check passes on them too."""
    if args.precision != "int8" or args.calibration or not args.input or _input_file(args):
        return
    import sys

    within = f" in [{args.range})" if args.range else ""
    print(
        f"fp16lens: note: INT8 is calibrated on generated inputs ({' '.join(args.input)}: "
        f"random values{within}, seed {args.seed}): its ranges fit those values, not "
        "your data, and its check runs on them too; give real batches (--calibration "
        "FILE, or an --input file)",
        file=sys.stderr,
    )


def _say_fixed_batch(args: argparse.Namespace, batches) -> None:
    """A note on stderr where the graph will take exactly the N items of an --input file's
    one batch (the example inputs fix the axes; a file of calibration images is no batch
    size a deployment chose)."""
    if args.dynamic or not _input_file(args) or len(batches) != 1:
        return
    firsts = {int(t.shape[0]) if getattr(t, "ndim", 0) else 0 for t in batches[0]}
    if len(firsts) == 1 and (n := firsts.pop()) > 1:
        import sys

        print(
            f"fp16lens: note: the graph takes exactly {n} items per batch, as the --input "
            "file's batch; give --dynamic batch for any batch size, or --input with a shape "
            "(1x...) and the file as --calibration",
            file=sys.stderr,
        )


def _export_onnx(export, args: argparse.Namespace):
    """An .onnx MODEL re-typed; the batches (--calibration, else --input) calibrate INT8."""
    if args.kwargs:
        raise Fp16LensError("--kwargs applies to a module:callable MODEL, not to an .onnx file")
    if args.dynamic:
        raise Fp16LensError("--dynamic applies to a PyTorch MODEL; an .onnx file keeps its axes")
    calibration: Sequence | None = None
    evaluation = onnx_batches(args) if args.precision == "fp16" and args.input else None
    if args.precision == "int8":
        if args.calibration:
            calibration = _batches_file(args.calibration, args.model)
            evaluation = onnx_batches(args) if _input_file(args) else None
        elif args.input:
            calibration = onnx_batches(args, split=False)  # export splits it, and says so
        else:
            raise Fp16LensError(
                "--precision int8 of an .onnx MODEL needs calibration batches: "
                "--input batches.npz (or --calibration FILE)"
            )
    with verbose(args.verbose):
        return export(
            args.model,
            None,
            args.output,
            precision=args.precision,
            calibration=calibration,
            target=args.target,
            max_fallback=args.max_fallback,
            float_parts=args.float_parts,
            fp32_modules=_names(args.fp32_modules) or None,
            fp32_nodes=_names(args.fp32_nodes) or None,
            io_dtype=args.io_dtype,
            evaluation=evaluation,
        )


def _batches_file(path: str, graph: str) -> list:
    """A --calibration file for an .onnx MODEL: an .npz is one batch by input name (or
    position), a .pt file a list of batches."""
    if path.lower().endswith(".npz"):
        return [graph_npz(path, graph, "--calibration")]
    return load_batches(path)


def _checked_on(args: argparse.Namespace) -> str:
    """What an FP16 file was checked on: an .onnx MODEL's --input batches, else the model's
    example inputs (the first --input batch, or the ones the MODEL brings)."""
    return "the evaluation batches (--input)" if is_onnx(args.model) else "the example inputs"


def _print(artifact, args: argparse.Namespace) -> int:
    """The summary; exit 1 when the written file fails its check (an FP16 file in real
    FP16; an INT8 file on the evaluation batches)."""
    parity = getattr(artifact, "parity", None)
    int8 = args.precision == "int8"
    summary = {
        "output": str(artifact.path),
        "precision": args.precision,
        "nodes": len(getattr(artifact, "nodes", ())),
        "fp32_nodes": list(getattr(artifact, "fp32_nodes", ())),
        "warnings": list(getattr(artifact, "warnings", ())),
        "fp16_check": parity.to_dict() if parity is not None and not int8 else None,
    }
    if int8:
        summary["int8_check"] = parity.to_dict() if parity is not None else None
        summary["int8_plan"] = getattr(artifact, "int8", None)
    failed = parity is not None and not parity.passed
    if args.json:
        emit_json(summary)
        return 1 if failed else 0
    con = console()
    typed = int8 and (summary.get("int8_plan") or {}).get("float_parts") == "fp16"
    con.print(
        f"{args.precision.upper()} ONNX{' (float parts typed FP16, opset ' + str(artifact.opset) + ')' if typed else ''} "
        f"written to {escape(str(artifact.path))} ({summary['nodes']} nodes)"
    )
    if parity is not None and parity.passed:
        how = "as TensorRT computes its Q/DQ graph" if int8 else "in real FP16"
        on = "the evaluation batches (--input)" if int8 else _checked_on(args)
        together = f"over its {parity.batches} batches together" if parity.batches > 1 else ""
        con.print(  # verify's measure; an INT8 target's worst output cosine is per batch
            f"checked {how} on {on}: cosine {parity.cosine:.6f} against FP32 "
            f"{together}{', ' if together else ''}the worst output"
        )
    for warning in summary["warnings"]:
        text = terminal_words(warning)
        head, *rest = clauses(text) if warning.startswith("INT8: ") else [text]
        con.print(f"[yellow]warning:[/] {escape(head)}")
        for clause in rest:  # the INT8 plan: one line per decision
            con.print(f"  - {escape(clause)}")
    return 1 if failed else 0


def clauses(text: str) -> list[str]:
    """``text`` split at each "; " outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and text.startswith("; ", i):
            out.append(text[start:i])
            start = i + 2
    return [*out, text[start:]]


_TERMINAL = (  # the library's words -> what a terminal user types
    ("fp16lens.scan(model, inputs), then fp16lens.patch", "`fp16lens scan`, then `fp16lens patch`"),
    ("fp16lens.verify(..., backend='onnx-fp16')", "`fp16lens verify --backend onnx-fp16`"),
    ("export(..., fp32_modules=[...])", "--fp32-modules NAME,..."),
    ("export(..., fp32_nodes=[...])", "--fp32-nodes NAME,..."),
    ("export precision='fp16'", "--precision fp16"),
    ("export(..., target=0.999)", "--target 0.999"),
    ("float_parts='fp32'", "--float-parts fp32"),
    ("float_parts='fp16'", "--float-parts fp16"),
    ("dynamic=('batch', 'sequence')", "--dynamic batch,sequence"),
    ("dynamic='batch'", "--dynamic batch"),
    ("dynamic='sequence'", "--dynamic sequence"),
)


def terminal_words(text: str) -> str:
    """An export warning as a terminal user acts on it (the JSON keeps the library's)."""
    for lib, cli in _TERMINAL:
        text = text.replace(lib, cli)
    text = re.sub(  # islands named one by one: export(..., fp32_nodes=['a', 'b'])
        r"export\(\.\.\., fp32_(modules|nodes)=\[('[^\]]*')\]\)",
        lambda m: f"--fp32-{m[1]} {','.join(n.strip().strip(chr(39)) for n in m[2].split(','))}",
        text,
    )
    return re.sub(r"export\(\.\.\., max_fallback=([0-9.]+)\)", r"--max-fallback \1", text)
