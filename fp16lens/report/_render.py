"""The terminal view of a report (rich), and its HTML/SVG/text and notebook exports.

``Report.__rich_console__`` calls :func:`render`, so ``rich.print(report)`` works; the
view options (``full``, ``top``) travel in a :class:`ReportView` wrapper.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType

from fp16lens._core import OptionError, ReportError
from fp16lens.report import _findview, _sections, _tables
from fp16lens.report._blocks import ViewOptions
from fp16lens.report._model import Report

EXPORT_WIDTH = 100
_FORMATS = ("html", "svg", "txt")
_NOTEBOOK_PRE = (
    '<pre style="white-space:pre;overflow-x:auto;line-height:normal;'
    "font-family:Menlo,'DejaVu Sans Mono',consolas,'Courier New',monospace\">{code}</pre>"
)


class ReportView:
    """A report with view options, as a rich renderable."""

    def __init__(self, report: Report, view: ViewOptions):
        self.report = report
        self.view = view

    def __rich_console__(self, console: Console, options: ConsoleOptions):
        yield from render(self.report, console, options, self.view)


def parts(report: Report, view: ViewOptions) -> list[RenderableType]:
    """Every renderable of the view, in order."""
    out: list[RenderableType] = [_sections.verdict(report)]
    if not report.clean:
        out += _findview.findings(report, view, "input")
        out += _findview.findings(report, view, "underflow")
    if not report.clean or report.spans:  # spans within a --threshold margin are shown too
        out += _sections.spans(report, view)
    if not report.clean:
        out += _findview.orphan_outputs(report, view)
        out += _findview.findings(report, view, "internal")
        out += _findview.findings(report, view, "parameter")
    out += _findview.findings(report, view, "note")
    if view.full:
        out += _tables.full_table(report)
    elif not report.clean:
        out += _tables.hottest(report, view.top)
    return out


def render(
    report: Report, console: Console, options: ConsoleOptions, view: ViewOptions | None = None
) -> Iterator[RenderableType]:
    """Yield the view's renderables (rich's ``__rich_console__`` protocol)."""
    yield from parts(report, view or ViewOptions())


def print_report(
    report: Report,
    *,
    full: bool = False,
    top: int = 10,
    console: Console | None = None,
    **view: Any,
) -> None:
    """Print the view to ``console`` (a new stdout console when None)."""
    (console or Console()).print(ReportView(report, ViewOptions(full=full, top=top, **view)))


def _recording_console(fmt: str, width: int) -> Console:
    colour = None if fmt == "txt" else "truecolor"
    return Console(
        record=True,
        width=width,
        file=io.StringIO(),
        color_system=colour,
        force_terminal=colour is not None,
        force_jupyter=False,
        legacy_windows=False,
    )


def export_text(report: Report, fmt: str, *, width: int = EXPORT_WIDTH, **view: Any) -> str:
    """The view as "html" (a page), "svg" (a terminal picture) or "txt" (plain text)."""
    if fmt not in _FORMATS:
        raise ReportError(f"cannot export a report as {fmt!r}; use one of {', '.join(_FORMATS)}")
    if not isinstance(width, int) or width < 40:
        raise OptionError(f"width must be an integer >= 40, got {width!r}")
    console = _recording_console(fmt, width)
    console.print(ReportView(report, ViewOptions(**view)))
    if fmt == "html":
        return console.export_html(inline_styles=True)
    if fmt == "svg":
        return console.export_svg(title=f"fp16lens · {report.meta.model_class or 'report'}")
    return console.export_text()


def mimebundle(report: Report) -> dict[str, str]:
    """Notebook display: the view as inline-styled HTML, and as plain text."""
    console = _recording_console("html", EXPORT_WIDTH)
    console.print(ReportView(report, ViewOptions()))
    html = console.export_html(inline_styles=True, code_format=_NOTEBOOK_PRE, clear=False)
    return {"text/html": html, "text/plain": console.export_text(styles=False)}
