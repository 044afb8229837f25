"""Where output goes: human output on stdout (rich), progress and errors on stderr, and
``--json`` documents on stdout (strict JSON: non-finite numbers become null)."""

from __future__ import annotations

import json
import math
import sys
from typing import IO, Any, cast

from rich.console import Console

PIPE_WIDTH = 120
"""Width when stdout is not a terminal (a CI log, a file): wide enough that every table
column stays (rich's default of 80 would cut the hottest-sites table)."""


def console(quiet: bool = False) -> Console:
    """stdout console; a quiet one (``--json``) records instead of printing."""
    if quiet:
        return Console(record=True, file=cast(IO[str], _Null()), width=100)  # rich only writes
    con = Console(file=sys.stdout, soft_wrap=False)
    if not con.is_terminal:
        con.width = max(con.width, PIPE_WIDTH)
    return con


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
