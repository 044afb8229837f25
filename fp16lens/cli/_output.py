"""Where output goes: human output on stdout (rich), progress and errors on stderr, and
``--json`` documents on stdout (strict JSON: non-finite numbers become null)."""

from __future__ import annotations

import codecs
import json
import math
import os
import sys
import unicodedata
from typing import IO, Any, cast

from rich.console import Console

PIPE_WIDTH = 120
"""Width when stdout is not a terminal (a CI log, a file) and ``COLUMNS`` does not set one:
wide enough that every table column stays (rich's default of 80 would cut the
hottest-sites table)."""


def console(quiet: bool = False) -> Console:
    """stdout console; a quiet one (``--json``) records instead of printing."""
    if quiet:
        return Console(record=True, file=cast(IO[str], _Null()), width=100)  # rich only writes
    con = Console(file=sys.stdout, soft_wrap=False)
    if not con.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit():
        con.width = max(con.width, PIPE_WIDTH)  # a width the user set is kept
    return con


ASCII_ERRORS = "fp16lens-ascii"
"""The encoding error handler ``plain_streams`` gives a stream that cannot hold the
report's symbols: each becomes ASCII that reads the same (``✓`` -> ``OK``, ``≤`` -> ``<=``)."""

_ASCII = {
    "✓": "OK",
    "✗": "X",
    "≤": "<=",
    "≥": ">=",
    "≈": "~",
    "±": "+-",
    "×": "x",
    "·": ".",
    "•": "*",
    "…": "...",
    "→": "->",
    "←": "<-",
    "—": "--",
    "–": "-",
    "−": "-",
    "²": "^2",
    "Σ": "sum ",
    "░": ".",
    "▒": ":",
    "▓": "#",
    "█": "#",
}


def _ascii_of(ch: str) -> str:
    if ch in _ASCII:
        return _ASCII[ch]
    name = unicodedata.name(ch, "")
    if name.startswith("BOX DRAWINGS"):  # rich's rules and bars
        return "-" if "HORIZONTAL" in name else "|" if "VERTICAL" in name else "+"
    plain = unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode()
    return plain or "?"  # é -> e; anything else (a spinner's braille) -> ?


def _to_ascii(exc: UnicodeError) -> tuple[str, int]:
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    return "".join(_ascii_of(c) for c in exc.object[exc.start : exc.end]), exc.end


codecs.register_error(ASCII_ERRORS, _to_ascii)


def plain_streams() -> None:
    """Let stdout and stderr take every character fp16lens prints, whatever the terminal's
    encoding: where it cannot hold ``✓`` (a Windows console piped to a file writes cp1252,
    ``PYTHONIOENCODING=ascii``), the symbols are written as ASCII instead of raising
    UnicodeEncodeError half-way through a report."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "✓✗≤…".encode(encoding)
        except (UnicodeEncodeError, LookupError):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(errors=ASCII_ERRORS)


def err_console() -> Console:
    return Console(file=sys.stderr)


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def jsonable(obj: Any) -> Any:
    """Plain JSON values: non-finite floats -> None, tuples -> lists, paths -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return jsonable(obj.item())
    return str(obj)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n")
