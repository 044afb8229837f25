"""The CLI's shared arguments: MODEL (``add_model_arguments``), the input options
(--input/--dtype/--range/--batches) and what they resolve to, for a torch MODEL or an
.onnx file (``onnx_batches``)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fp16lens._core import Fp16LensError
from fp16lens.cli._models import MODEL_HELP

if TYPE_CHECKING:  # torch is imported when inputs are made, not for `fp16lens --help`
    from fp16lens.cli._inputs import Batch, InputSpec


_NEGATIVE = re.compile(r"^-(\d|\.\d|inf)", re.IGNORECASE)
VALUE_OPTIONS = ("--range",)


def attach_negative_values(argv: list[str]) -> list[str]:
    """``--range -1,1`` -> ``--range=-1,1``: argparse takes a value that starts with "-"
    (and is not a plain number) for an option."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if out and out[-1] in VALUE_OPTIONS and _NEGATIVE.match(arg) and argv[i - 1] == out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def add_input_arguments(parser: argparse.ArgumentParser, batches: bool = True) -> None:
    group = parser.add_argument_group("inputs")
    group.add_argument(
        "--input",
        nargs="+",
        metavar="SPEC",
        help="a shape per positional input (1x3x224x224 1x10), or one .pt/.npz/.npy file of batches; "
        "optional for `demo` and for callables that return (model, inputs)",
    )
    group.add_argument(
        "--dtype",
        default=None,
        help="dtype of generated inputs (default float32), or the dtype a file's arrays are "
        "cast to (uint8 pixels for a float model: --dtype float32): float32, float16, int64, "
        "... (one, or one per input)",
    )
    group.add_argument(
        "--range",
        default=None,
        metavar="LOW,HIGH",
        help="value range of generated inputs: floats LOW <= x < HIGH (default 0,1), integers "
        "LOW <= x < HIGH as in range() (default 0,10: token ids for a vocabulary of 100 are "
        "--range 0,100); a negative LOW works as written: --range -1,1",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of generated inputs")
    group.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="split the batch in an input file along its first axis into batches of this size",
    )
    if batches:
        group.add_argument(
            "--batches",
            type=int,
            default=1,
            metavar="N",
            help="how many generated batches to run (default 1)",
        )


def batches_from_args(
    args: argparse.Namespace, default: Batch | None = None, model=None
) -> Sequence[Batch]:
    """The batches the options describe, or ``default`` (the model source's own inputs);
    float inputs of another dtype than ``model``'s are cast to it, with a note on stderr."""
    from fp16lens.cli._refusal import remember

    batches = _batches(args, default)
    batches = batches if model is None else match_model_dtype(batches, model)
    remember(args, model, batches)
    return batches


def match_model_dtype(batches: Sequence[Batch], model) -> Sequence[Batch]:
    """Float tensors cast to the model's float dtype (numpy's float64 arrays for a float32
    model would fail in the first conv); a one-line note on stderr says so."""
    import sys

    from fp16lens._core.model_dtype import half_model, model_float_dtype

    want = model_float_dtype(model)
    made = hasattr(batches, "map")  # generated batches share their dtypes: look at one
    found = {
        t.dtype
        for b in (batches[:1] if made else batches)
        for t in (b.values() if isinstance(b, dict) else b)
        if _is_float(t) and t.dtype != want
    }
    if want is None or not found:
        return batches
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in found))
    if half_model(model) is None:  # scan and patch refuse a float16 model in one line
        print(
            f"fp16lens: note: {names} inputs cast to the model's {str(want).removeprefix('torch.')}",
            file=sys.stderr,
        )

    def cast(b):
        if isinstance(b, dict):
            return {k: t.to(want) if _is_float(t) else t for k, t in b.items()}
        return tuple(t.to(want) if _is_float(t) else t for t in b)

    return batches.map(cast) if hasattr(batches, "map") else [cast(b) for b in batches]


def _is_float(t) -> bool:
    return hasattr(t, "is_floating_point") and t.is_floating_point()


def _batches(args: argparse.Namespace, default: Batch | None) -> Sequence[Batch]:
    from fp16lens.cli._batchfile import load_batches
    from fp16lens.cli._inputs import is_file_spec

    specs = args.input
    if not specs:
        if default is None:
            raise Fp16LensError(
                f"{args.model} needs example inputs: give --input with a shape per input "
                "(e.g. --input 1x3x224x224) or a .pt/.npz/.npy file of batches"
            )
        if getattr(args, "batches", 1) > 1:
            import sys

            print(
                f"fp16lens: note: --batches {args.batches} does not apply: {args.model} brings its "
                "own inputs (one batch); give --input SHAPE or a file of batches for more",
                file=sys.stderr,
            )
        return [default]
    files = [s for s in specs if is_file_spec(s)]
    if files:
        if len(specs) != 1:
            raise Fp16LensError(
                "--input takes either shapes or one .pt/.npz/.npy file of batches, not both or "
                f"several files (got {' '.join(specs)})"
            )
        return cast_batches(load_batches(files[0], args.batch_size), args.dtype)
    return spec_from_args(args).make()


def cast_batches(batches: Sequence, dtype: str | None) -> Sequence:
    """Each batch's arrays or tensors cast to ``--dtype`` (one, or one per input), where it
    was given; the batches as they are otherwise."""
    if dtype is None:
        return batches
    import numpy as np
    import torch

    from fp16lens.cli._inputs import parse_dtypes

    def cast(b):
        if isinstance(b, dict):
            items = list(b.values())
            wanted = parse_dtypes(dtype, len(items))
            return {k: _cast(v, d, np, torch) for (k, v), d in zip(b.items(), wanted)}
        items = list(b) if isinstance(b, (tuple, list)) else [b]
        wanted = parse_dtypes(dtype, len(items))
        done = tuple(_cast(v, d, np, torch) for v, d in zip(items, wanted))
        return done if isinstance(b, (tuple, list)) else done[0]

    return [cast(b) for b in batches]


def _cast(v, dtype, np, torch):
    if torch.is_tensor(v):
        return v.to(dtype)
    if isinstance(v, np.ndarray):  # numpy has no bfloat16: that one becomes a tensor
        return (
            torch.from_numpy(v).to(dtype)
            if dtype == torch.bfloat16
            else v.astype(torch.empty(0, dtype=dtype).numpy().dtype)
        )
    return v


def spec_from_args(args: argparse.Namespace) -> InputSpec:
    from fp16lens.cli._inputs import InputSpec, parse_dtypes, parse_range, parse_shape

    shapes = tuple(parse_shape(s) for s in args.input)
    dtypes = tuple(parse_dtypes(args.dtype or "float32", len(shapes)))
    floats = all(d.is_floating_point for d in dtypes)
    low, high = parse_range(args.range) if args.range else ((0.0, 1.0) if floats else (0.0, 10.0))
    count = getattr(args, "batches", 1)
    if count < 1:
        raise Fp16LensError(f"--batches must be >= 1, got {count}")
    return InputSpec(shapes, dtypes, low, high, batches=count, seed=args.seed)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--kwargs", default=None, help="JSON keyword arguments for a MODEL callable")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the traceback of an error, and let torch's and ONNX Runtime's own warnings "
        "and log output through",
    )


def onnx_batches(args: argparse.Namespace, split: bool = True) -> Sequence:
    """The --input batches for an .onnx MODEL (scan, verify, patch's FP32 check, export's
    FP16 check); a file's one batch of N items split as the graph's fixed first axis takes
    them (``fitted``) unless ``split`` is False (INT8 calibration: export splits it)."""
    specs = args.input or []
    if len(specs) == 1 and specs[0].lower().endswith(".npz") and args.batch_size is None:
        batches: Sequence = cast_batches([graph_npz(specs[0], args.model)], args.dtype)
    else:
        batches = batches_from_args(args, None)
    return fitted(args, batches, args.model) if split else batches


def graph_npz(path: str, graph: str, flag: str = "--input"):
    """An .npz file as one batch for the .onnx ``graph``: a dict by input name, or its
    arrays in file order where their names are not the graph's inputs (numpy.savez's
    arr_0, or x for an input called input) and their count is."""
    import numpy as np

    batch = npz_batch(Path(path), np, flag)
    wanted = _graph_inputs(graph)
    if (
        isinstance(batch, dict)
        and wanted
        and set(batch) != set(wanted)
        and len(batch) == len(wanted)
    ):
        return tuple(batch.values())  # names that are not the graph's: by position
    return batch


def fitted(args: argparse.Namespace, batches: Sequence, onnx_file: str) -> Sequence:
    """``batches`` as ``onnx_file`` takes them: the one batch of an --input file (no
    --batch-size) split along its first axis where the graph declares a smaller fixed one
    (a file of N images for a graph exported with batch 1), with a note on stderr."""
    from fp16lens._core.feeds import declared_batch, split_to_declared
    from fp16lens.cli._inputs import is_file_spec

    specs = args.input or []
    if args.batch_size is not None or len(specs) != 1 or not is_file_spec(specs[0]):
        return batches
    if not isinstance(batches, list) or len(batches) != 1:
        return batches
    parts, note = split_to_declared(batches, declared_batch(onnx_file))
    if note:
        import sys

        print(f"fp16lens: note: {note}; --batch-size N splits it otherwise", file=sys.stderr)
    return parts


def _graph_inputs(path: str) -> list[str]:
    """The names of an ONNX file's graph inputs (initializers excluded); [] if unreadable."""
    try:
        import onnx

        graph = onnx.load(path, load_external_data=False).graph
    except Exception:  # the scan itself says what is wrong with the file
        return []
    init = {i.name for i in graph.initializer}
    return [i.name for i in graph.input if i.name not in init]


def npz_batch(path: Path, np, flag: str = "--input") -> dict | tuple:
    from fp16lens.cli._batchfile import load_batches

    if not path.is_file():
        raise Fp16LensError(
            f"cannot read {flag} {path}: no such file; give a .npz of the graph's inputs "
            "(numpy.savez(path, name=array))"
            + (" or shapes such as 1x3x224x224" if flag == "--input" else "")
        )
    with np.load(path) as data:
        named = {k: data[k] for k in data.files}
    if all(k.startswith("arr_") for k in named):  # numpy.savez(path, a, b): positional
        return load_batches(path)[0]
    return named
