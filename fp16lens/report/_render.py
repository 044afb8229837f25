"""The terminal view of a report (rich), and its HTML/SVG/text and notebook exports.

``Report.__rich_console__`` calls :func:`render`, so ``rich.print(report)`` works; the
view options (``full``, ``top``) travel in a :class:`ReportView` wrapper.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from typing import Any, Literal

from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.measure import Measurement
from rich.text import Text

from fp16lens._core import OptionError, ReportError
from fp16lens.report import _findview, _sections, _tables
from fp16lens.report._blocks import Indented, ViewOptions
from fp16lens.report._model import Report

EXPORT_WIDTH = 100
MAX_EXPORT_WIDTH = 240
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
    colour: Literal["truecolor"] | None = None if fmt == "txt" else "truecolor"
    return Console(
        record=True,
        width=width,
        file=io.StringIO(),
        color_system=colour,
        force_terminal=colour is not None,
        force_jupyter=False,
        legacy_windows=False,
    )


def content_width(report: Report, view: ViewOptions) -> int:
    """The width the view's tables ask for (whole site names, every column), within
    [EXPORT_WIDTH, MAX_EXPORT_WIDTH]: what the SVG and text exports are drawn at.
    Paragraphs wrap at any width and do not count."""
    console = _recording_console("txt", MAX_EXPORT_WIDTH)
    widest = max(
        (
            Measurement.get(console, console.options, part).maximum
            for part in parts(report, view)
            if not isinstance(part, (Text, Indented, Group))
        ),
        default=EXPORT_WIDTH,
    )
    return max(EXPORT_WIDTH, min(MAX_EXPORT_WIDTH, widest))


_FONT_FACE = re.compile(r"@font-face\s*\{[^}]*\}\s*")
_MONO = "'Fira Code', 'DejaVu Sans Mono', Menlo, Consolas, 'Liberation Mono', monospace"


def _offline_svg(svg: str) -> str:
    """rich's SVG without its web fonts (fetched from a CDN): local monospace fonts only."""
    svg = _FONT_FACE.sub("", svg)
    return re.sub(r"font-family:\s*Fira Code,\s*monospace", f"font-family: {_MONO}", svg)


def export_text(report: Report, fmt: str, *, width: int | None = None, **view: Any) -> str:
    """The view as "html" (a self-contained page: report/_html.py), "svg" (a terminal
    picture) or "txt" (plain text); SVG and text at ``width`` columns, by default the
    width of their content (at least 100, at most 240)."""
    if fmt not in _FORMATS:
        raise ReportError(f"cannot export a report as {fmt!r}; use one of {', '.join(_FORMATS)}")
    if width is not None and (not isinstance(width, int) or width < 40):
        raise OptionError(f"width must be an integer >= 40, got {width!r}")
    options = ViewOptions(**view)
    if fmt == "html":
        from fp16lens.report._html import page

        return page(report, options)
    console = _recording_console(fmt, width or content_width(report, options))
    console.print(ReportView(report, options))
    if fmt == "svg":
        return _offline_svg(
            console.export_svg(title=f"fp16lens · {report.meta.model_class or 'report'}")
        )
    return console.export_text()


def mimebundle(report: Report) -> dict[str, str]:
    """Notebook display: the view as inline-styled HTML, and as plain text."""
    console = _recording_console("html", EXPORT_WIDTH)
    console.print(ReportView(report, ViewOptions()))
    html = console.export_html(inline_styles=True, code_format=_NOTEBOOK_PRE, clear=False)
    return {"text/html": html, "text/plain": console.export_text(styles=False)}
