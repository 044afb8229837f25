"""`fp16lens verify MODEL CANDIDATE --backend B --input SPEC`: parity of CANDIDATE (an
ONNX file, or a model) run in FP16 against MODEL in FP32 (a model, or an FP32 .onnx file
run in ONNX Runtime); exit 1 when it fails."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp16lens._core import Fp16LensError
from fp16lens._core.onnx_types import is_onnx
from fp16lens._core.sites import Backend
from fp16lens.cli._inputargs import (
    add_input_arguments,
    add_model_arguments,
    batches_from_args,
    fitted,
    onnx_batches,
)
from fp16lens.cli._models import MODEL_HELP, load_model, parse_kwargs
from fp16lens.cli._output import console, emit_json
from fp16lens.cli._summary import parity_summary


class BackendChoices:
    """``--backend`` choices: "auto" and the names registered with fp16lens.verify, read when
    the command line is parsed or its help shown (the stage is not imported to build the
    parser). Without a verify stage any name passes and the command says what is missing."""

    def _names(self) -> tuple[str, ...]:
        from fp16lens.verify import backends

        return ("auto", *(str(name) for name in backends()))

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        names = self._names()
        return not names or name in names


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="FP32 vs FP16 parity", description=__doc__)
    add_model_arguments(p)
    p.add_argument("candidate", metavar="CANDIDATE", help=f"an .onnx file, or {MODEL_HELP}")
    p.add_argument(
        "--backend",
        choices=BackendChoices(),
        default=None,
        help=f"how CANDIDATE runs (default auto: {Backend.ONNX_INT8} for an .onnx file with "
        f"QuantizeLinear/DequantizeLinear nodes, {Backend.ONNX_FP16} for other .onnx files, "
        f"else {Backend.TORCH_FP16})",
    )
    p.add_argument("--tolerance", type=float, default=None, help="pass threshold (backend default)")
    p.add_argument(
        "--about-mean",
        action="store_true",
        default=None,
        help="hold each output's cosine about FP32's mean to the threshold too: scores that "
        "share an offset (a MOS of 1 to 5), whose error the plain cosine cannot see (on for "
        "INT8)",
    )
    add_input_arguments(p)
    p.add_argument("--json", action="store_true", help="print the parity metrics as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fp16lens.verify import verify

    onnx_candidate = is_onnx(args.candidate)
    if onnx_candidate and not Path(args.candidate).is_file():
        raise Fp16LensError(
            f"ONNX candidate {args.candidate} does not exist; write one with `fp16lens export`"
        )
    if is_onnx(args.model):  # the FP32 graph in ONNX Runtime is the reference
        if args.kwargs:
            raise Fp16LensError("--kwargs applies to a module:callable MODEL, not to an .onnx file")
        reference, batches = args.model, onnx_batches(args)
    else:
        loaded = load_model(args.model, parse_kwargs(args.kwargs))
        reference = loaded.model
        batches = batches_from_args(args, loaded.example_inputs, loaded.model)
    if onnx_candidate and not is_onnx(args.model):  # a torch MODEL: split as the file takes it
        batches = fitted(args, batches, args.candidate)
    candidate = args.candidate if onnx_candidate else load_model(args.candidate).model
    result = verify(
        reference,
        candidate,
        batches,
        backend=args.backend,
        tolerance=args.tolerance,
        about_mean=args.about_mean,
    )
    if args.json:
        emit_json({"backend": result.backend, **parity_summary(result)})
        return 0 if result else 1
    con = console()
    con.print(result)
    return 0 if result else 1
