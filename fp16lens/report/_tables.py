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


def shorten(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters: its head and its (more telling) tail
    around "…" (``backbone.…layer4.1.bn2``)."""
    if len(name) <= width:
        return name
    head = max(1, (width - 1) // 3)
    return name[:head] + "…" + name[len(name) - (width - 1 - head) :]


# Columns a narrow terminal drops first; the site, its headroom and its bar always stay.
_LAYOUTS = (
    ("op", "share", 16),
    ("share", 16),
    (16,),
    (10,),
)
_SHORT = 36  # a shortened site name keeps at least this many characters where it can


class Hottest:
    """The hottest sites as a table that fits the console: in a narrow one it drops the op
    and the share of 65504 columns, then narrows the bar, then shortens the site names;
    the headroom and the bar stay."""

    def __init__(self, sites: list[SiteStats]):
        self.sites = sites

    def table(self, layout: tuple, names: list[str]) -> Table:
        *optional, bar = layout
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False)
        longest = max(len(n) for n in names)
        table.add_column("site", overflow="fold", min_width=min(longest, 44))
        if "op" in optional:
            table.add_column("op", overflow="ellipsis", no_wrap=True, max_width=14)
        table.add_column("absmax", justify="right")
        if "share" in optional:
            table.add_column("of 65504", justify="right")
        table.add_column("headroom", justify="right", no_wrap=True)
        table.add_column("2^-14 … 2^16" if bar >= 12 else "log2 bar", no_wrap=True)
        for s, name in zip(self.sites, names):
            cells = [name]
            if "op" in optional:
                cells.append(s.op)
            cells.append(_fmt.value(s.absmax))
            if "share" in optional:
                cells.append(_fmt.share_of_limit(s.absmax))
            table.add_row(*cells, f"{_fmt.bits(s.headroom)} bits", headroom_bar(s, bar))
        return table

    def _others(self, console, options, layout: tuple) -> int:
        """The table's width without the site column's text (one-character names: the
        column is as wide as its header then)."""
        narrow = self.table(layout, ["x"] * len(self.sites))
        return Measurement.get(console, options, narrow).maximum - len("site")

    def layout(self, console, options) -> tuple[tuple, list[str]]:
        width = options.max_width
        names = [s.name for s in self.sites]
        longest = max(len(n) for n in names)
        others = {layout: self._others(console, options, layout) for layout in _LAYOUTS}
        for layout in _LAYOUTS:  # whole names, with as many columns as fit
            if longest + others[layout] <= width:
                return layout, names
        # names shortened to at least _SHORT characters, with the full bar if that fits
        layout = next((lay for lay in _LAYOUTS[1:] if width - others[lay] >= _SHORT), _LAYOUTS[-1])
        room = max(12, width - others[layout])
        return layout, [shorten(n, room) for n in names]

    def __rich_console__(self, console, options):
        yield self.table(*self.layout(console, options))

    def __rich_measure__(self, console, options):
        return Measurement.get(
            console, options, self.table(_LAYOUTS[0], [s.name for s in self.sites])
        )


def hottest(report: Report, top: int) -> list[RenderableType]:
    """The ``top`` sites by absmax, with headroom in bits, share of 65504 and a bar."""
    if not report.sites:
        return []
    title = f"Hottest sites (top {min(top, len(report.sites))} of {len(report.sites)})"
    return [Text.assemble(("\n" + title, "bold underline")), Hottest(report.hottest(top))]


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
