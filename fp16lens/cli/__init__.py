"""The ``fp16lens`` command (also ``python -m fp16lens``).

User and environment problems (``Fp16LensError``) print ``fp16lens: error: <message>``
on stderr and exit 2 without a traceback, as Polygraphy's tools do; anything else is a
bug in fp16lens and keeps its traceback.
"""

from __future__ import annotations

import sys

from fp16lens._core import Fp16LensError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    from fp16lens.cli._inputargs import attach_negative_values
    from fp16lens.cli._parser import build_parser

    parser = build_parser()
    argv = attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help/--version (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.run(args)
    except Fp16LensError as exc:
        message = " ".join(str(exc).split())
        print(f"fp16lens: error: {message}", file=sys.stderr)
        return 2
