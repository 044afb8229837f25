"""Errors that mean a user or environment problem.

The CLI prints their message and exits with status 2, without a traceback.
Anything else is a bug in fp16lens and keeps its traceback.
"""


class Fp16LensError(Exception):
    """A problem with the user's input or environment; the message names the fix."""


class MissingDependencyError(Fp16LensError, ImportError):
    """An optional dependency is not installed; the message names the extra."""

    def __init__(self, module: str, extra: str, purpose: str = ""):
        self.module = module
        self.extra = extra
        why = f" (needed for {purpose})" if purpose else ""
        super().__init__(
            f"{module} is not installed{why}. Install it with: pip install -e '.[{extra}]' "
            "(in the fp16lens clone)"
        )


class WatchError(Fp16LensError):
    """watch() was given something it cannot observe, or the watched forward failed."""


class ReportError(Fp16LensError):
    """A report file is unreadable, from another schema, or does not match the model."""


class PatchError(Fp16LensError):
    """patch() preconditions failed; the model was left untouched."""


class ExportError(Fp16LensError):
    """The model cannot be exported as asked; the message names the tensor or module and the fix."""


class VerifyError(Fp16LensError):
    """verify() was given a reference, candidate or inputs it cannot compare; the message says
    what to pass instead."""


class StaleReportError(ReportError):
    """The report was made from other weights than the model's: its ranges do not apply."""


class OutputPathError(Fp16LensError, OSError):
    """An output path cannot be written; raised before any work so nothing is half-written."""


class OptionError(Fp16LensError, ValueError):
    """An option has a value it cannot take (a threshold of -1, a tolerance of 2): a user
    problem for the CLI (one line, exit 2) and still a ``ValueError`` for Python callers."""


class UnknownBackendError(VerifyError, ValueError):
    """verify() was asked for a backend no one registered; the message lists the known ones."""
