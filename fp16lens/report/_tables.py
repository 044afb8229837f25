"""Site tables: the hottest sites with a headroom bar, and every site (``full=True``)."""

from __future__ import annotations

from rich import box
from rich.console import RenderableType
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from fp16lens.report import _fmt
from fp16lens.report._model import Report, SiteStats

BAR_WIDTH = 16


def _style(s: SiteStats) -> str:
    if s.headroom < 0:
        return "red"
    return "yellow" if s.headroom < 1 else "green"


def headroom_bar(s: SiteStats, width: int = BAR_WIDTH) -> Text:
    """log2 scale from 2^-14 (empty) to 65504 (full); beyond the limit it ends in "!"."""
    filled = _fmt.bar_fill(s.absmax, width)
    over = s.headroom < 0
    text = Text("█" * (filled - over), _style(s))
    text.append("!" if over else "", "bold red")
    text.append("░" * (width - filled), "dim")
    return text


def hottest(report: Report, top: int) -> list[RenderableType]:
    """The ``top`` sites by absmax, with headroom in bits, share of 65504 and a bar."""
    if not report.sites:
        return []
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False)
    top_sites = report.hottest(top)
    longest = max(len(s.name) for s in top_sites)
    table.add_column("site", overflow="fold", min_width=min(longest, 44))
    table.add_column("op", overflow="ellipsis", no_wrap=True, max_width=14)
    table.add_column("absmax", justify="right")
    table.add_column("of 65504", justify="right")
    table.add_column("headroom", justify="right")
    table.add_column("2^-14 … 2^16", no_wrap=True)
    for s in top_sites:
        table.add_row(
            s.name,
            s.op,
            _fmt.value(s.absmax),
            _fmt.share_of_limit(s.absmax),
            f"{_fmt.bits(s.headroom)} bits",
            headroom_bar(s),
        )
    title = f"Hottest sites (top {min(top, len(report.sites))} of {len(report.sites)})"
    return [Text.assemble(("\n" + title, "bold underline")), table]


def _row(s: SiteStats) -> tuple[str, ...]:
    return (
        s.name,
        s.op,
        str(s.calls),
        _fmt.value(s.absmax),
        _fmt.bits(s.headroom),
        f"{100 * s.subnormal_share:.1f}%",
    )


_HEADER = ("site", "op", "calls", "absmax", "headroom", "subnormal")


class _Lines:
    """Pre-formatted lines as plain segments: 10,000 rows render in milliseconds."""

    def __init__(self, lines: list[str]):
        self.lines = lines

    def __rich_console__(self, console, options):
        width = options.max_width
        for line in self.lines:
            yield Segment(line if len(line) <= width else line[: width - 1] + "…")
            yield Segment.line()

    def __rich_measure__(self, console, options):
        longest = max((len(line) for line in self.lines), default=0)
        return Measurement(longest, longest)


def full_table(report: Report) -> list[RenderableType]:
    """Every site in execution order, as fixed-width text (fast for 10,000 sites)."""
    rows = [_HEADER, *(_row(s) for s in report.sites.values())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    lines = []
    for n, r in enumerate(rows):
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])]
        cells += [c.rjust(w) for c, w in zip(r[2:], widths[2:])]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("─" * w for w in widths))
    title = f"All sites ({len(report.sites)}, execution order)"
    return [Text.assemble(("\n" + title, "bold underline")), _Lines(lines)]
