"""Small rich building blocks and the view options shared by the sections."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.measure import Measurement
from rich.segment import Segment
from rich.text import Text

from fp16lens._core import OptionError
from fp16lens.report._advice import suggest_fix
from fp16lens.report._fmt import plural
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


class Indented:
    """``text`` wrapped to the width left after ``left`` spaces, every line indented, and no
    line padded on the right (rich's Padding fills each line to the widest one: trailing
    blanks in a log, a pipe or a copied line)."""

    def __init__(self, text: Text, left: int):
        self.text, self.left = text, left

    def __rich_console__(self, console, options):
        width = max(1, options.max_width - self.left)
        lines = console.render_lines(self.text, options.update_width(width), pad=False)
        for line in lines:
            while line and not line[-1].text.rstrip():  # blank segments at the end
                line = line[:-1]
            if line:  # the space a wrap leaves at the break
                last = line[-1]
                line = [*line[:-1], Segment(last.text.rstrip(), last.style, last.control)]
            yield Segment(" " * self.left)
            yield from line
            yield Segment.line()

    def __rich_measure__(self, console, options):
        measured = Measurement.get(console, options, self.text)
        return Measurement(measured.minimum + self.left, measured.maximum + self.left)


def indent(text: Text, left: int = 4) -> Indented:
    """Continuation lines of a wrapped paragraph stay indented."""
    return Indented(text, left)


def fix_line(report: Report, item: Span | Finding, site: str | None = None) -> Indented:
    """The item's fix; ``site``: written for the item's own site (a block of findings
    that differ only in their sites' numbers, see ``_findview``)."""
    fix = suggest_fix(report, item)
    if site is not None and isinstance(item, Finding) and item.site:
        fix = fix.replace(item.site, site)
    return indent(Text.assemble(("fix: ", "bold green"), fix))


def heading(title: str, note: str = "") -> Text:
    return Text.assemble(("\n" + title, "bold underline"), (f"  {note}" if note else "", "dim"))


def more(shown: int, total: int, noun: str, hint: str) -> list[Text]:
    """The line that says how many items (``noun``, singular) are hidden, and how to see
    them (``hint``): "… 1 more span", "… 3 more internal risks"."""
    if total <= shown:
        return []
    return [Text(f"  … {plural(total - shown, 'more ' + noun)}: {hint}", "dim")]


def peak_key(peak: float) -> float:
    return math.inf if math.isnan(peak) else peak
