"""The ``fp16lens`` command (also ``python -m fp16lens``).

User and environment problems (``Fp16LensError``) print ``fp16lens: error: <message>``
on stderr and exit 2 without a traceback, as Polygraphy's tools do; so does a model that
refuses the inputs it was given (checked by running it again outside fp16lens, see
``_refusal``). Ctrl-C exits 130 with one line. Anything else is a bug in fp16lens and
keeps its traceback; ``--verbose`` (or ``FP16LENS_TRACEBACK=1``) shows the traceback of
every error.
"""

from __future__ import annotations

import os
import sys

from fp16lens._core import Fp16LensError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    from fp16lens.cli._inputargs import attach_negative_values
    from fp16lens.cli._output import plain_streams
    from fp16lens.cli._parser import build_parser

    plain_streams()
    parser = build_parser()
    argv = attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help/--version (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    tracebacks = getattr(args, "verbose", False) or os.environ.get("FP16LENS_TRACEBACK") == "1"
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("fp16lens: interrupted", file=sys.stderr)
        return 130
    except Fp16LensError as exc:
        if tracebacks:
            raise
        return _error(str(exc))
    except Exception as exc:
        from fp16lens.cli._refusal import refusal

        why = None if tracebacks else refusal(args, exc)
        if why is None:
            raise  # a bug in fp16lens: keep its traceback
        return _error(why)


def _error(message: str) -> int:
    print(f"fp16lens: error: {' '.join(message.split())}", file=sys.stderr)
    return 2
