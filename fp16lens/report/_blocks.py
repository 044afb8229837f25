"""Small rich building blocks and the view options shared by the sections."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.padding import Padding
from rich.text import Text

from fp16lens._core import OptionError
from fp16lens.report._advice import suggest_fix
from fp16lens.report._model import Finding, Report, Span


@dataclass(frozen=True)
class ViewOptions:
    """What the terminal view shows: the top ``top`` items of each part, or everything."""

    full: bool = False
    top: int = 10
    path_keep: int = 9  # sites shown per span path before the middle collapses
    full_hint: str = "report.print(full=True) shows all"  # how the reader sees everything

    def __post_init__(self):
        if not isinstance(self.top, int) or self.top < 1:
            raise OptionError(f"top must be an integer >= 1, got {self.top!r}")
        if not isinstance(self.path_keep, int) or self.path_keep < 3:
            raise OptionError(f"path_keep must be an integer >= 3, got {self.path_keep!r}")


def indent(text: Text, left: int = 4) -> Padding:
    """Continuation lines of a wrapped paragraph stay indented."""
    return Padding(text, (0, 0, 0, left), expand=False)


def fix_line(report: Report, item: Span | Finding) -> Padding:
    fix = suggest_fix(report, item)
    return indent(Text.assemble(("fix: ", "bold green"), fix))


def heading(title: str, note: str = "") -> Text:
    return Text.assemble(("\n" + title, "bold underline"), (f"  {note}" if note else "", "dim"))


def more(shown: int, total: int, what: str, hint: str) -> list[Text]:
    """The line that says how many items are hidden, and how to see them (``hint``)."""
    if total <= shown:
        return []
    hidden = total - shown
    what = what.removesuffix("s") if hidden == 1 else what  # "spans", "internal risks"
    return [Text(f"  … {hidden} more {what}: {hint}", "dim")]


def peak_key(peak: float) -> float:
    return math.inf if math.isnan(peak) else peak
