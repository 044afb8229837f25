"""Keep third-party progress prints, log lines and warnings out of library output."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings


@contextlib.contextmanager
def quiet(*logger_names: str):
    """Silence stdout, Python warnings and the named loggers (``""`` is the root) inside."""
    loggers = [logging.getLogger(n or None) for n in logger_names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
