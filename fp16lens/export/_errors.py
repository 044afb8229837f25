"""The export stage's error: a model or option that cannot become the requested artifact."""

from __future__ import annotations

from fp16lens._core import Fp16LensError


class ExportError(Fp16LensError):
    """The model cannot be exported as asked; the message names the tensor or module and the fix."""
