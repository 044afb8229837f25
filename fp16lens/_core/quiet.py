"""Keep third-party progress prints, log lines and warnings out of library output.

torch's exporters print progress (with ANSI colours), log graph dumps through their own
loggers and handlers, and warn about their own deprecations; none of it is the user's
business unless asked for: ``verbose()`` (the CLI's ``--verbose``) lets it all through.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import logging
import re
import warnings

_VERBOSE = contextvars.ContextVar("fp16lens_verbose", default=False)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@contextlib.contextmanager
def verbose(on: bool = True):
    """Inside, ``quiet()`` silences nothing: third-party output shows as it is."""
    token = _VERBOSE.set(on)
    try:
        yield
    finally:
        _VERBOSE.reset(token)


@contextlib.contextmanager
def quiet(*logger_names: str, stderr: bool = True):
    """Silence stdout, Python warnings, logging (every logger, whatever its own handlers
    and levels: torch configures its own) and, with ``stderr``, direct prints to stderr
    (torch.export prints a failed trace's partial graph there) inside. ``stderr=False``
    keeps a progress bar on stderr alive. ``logger_names`` are kept for callers that name
    the loggers they expect (``""`` is the root)."""
    if _VERBOSE.get():
        yield
        return
    del logger_names  # logging.disable covers every logger
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    sink = io.StringIO()
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink) if stderr else contextlib.nullcontext(),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def plain(text: str) -> str:
    """``text`` without ANSI colour codes (torch's exporter colours its error messages)."""
    return _ANSI.sub("", text)
