"""The report as a picture: log2 |x| of every site along execution order.

matplotlib is optional (``pip install -e '.[plot]'`` in a clone) and used without pyplot:
a ``Figure`` on an Agg canvas, so no global state or GUI backend is touched. The figure
has a ``_repr_png_``, so ``fig = report.plot(); fig`` shows the picture in a notebook.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp16lens._core import OptionError, ReportError, import_optional
from fp16lens._core.sites import Mechanism
from fp16lens.report._fmt import LOG2_MAX, LOG2_MIN_NORMAL, log2_abs
from fp16lens.report._model import Report

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LOG2_MIN_SUBNORMAL = -24.0
_OVER = "#d62728"
_OK = "#1f77b4"
_INTERNAL = "#ff7f0e"
_PARAM = "#8e44ad"
TICKS_PER_INCH = 2.2  # site names on the x axis: at most this many per inch of figure width


@dataclass(frozen=True)
class PlotOptions:
    width: float = 11.0  # inches
    height: float = 4.5
    dpi: int = 110
    span_labels: int = 8  # label at most this many span starts (the worst ones)

    def __post_init__(self):
        if not (self.width > 0 and self.height > 0):
            raise OptionError(f"width and height must be > 0, got {self.width} x {self.height}")
        if not isinstance(self.dpi, int) or self.dpi < 20:
            raise OptionError(f"dpi must be an integer >= 20, got {self.dpi!r}")
        if not isinstance(self.span_labels, int) or self.span_labels < 0:
            raise OptionError(f"span_labels must be an integer >= 0, got {self.span_labels!r}")


def _positions(report: Report) -> tuple[dict[str, int], list[float]]:
    """Site -> x (execution order) and log2 |absmax| per x."""
    order = sorted(report.sites.values(), key=lambda s: s.order)
    return {s.name: i for i, s in enumerate(order)}, [log2_abs(s.absmax) for s in order]


def _ylim(ys: list[float]) -> tuple[float, float]:
    """Room below the smallest value and above the largest for the span labels."""
    finite = [y for y in ys if math.isfinite(y)]
    low = min([*finite, LOG2_MIN_NORMAL]) - 2
    high = max([*finite, LOG2_MAX]) + 6
    return max(low, LOG2_MIN_SUBNORMAL - 4), high


def _draw_sites(ax, ys: list[float], top: float) -> None:
    shown = [(x, min(y, top)) for x, y in enumerate(ys) if y != -math.inf]
    ax.plot(
        [x for x, _ in shown],
        [y for _, y in shown],
        color=_OK,
        lw=0.9,
        label="log2 |x| per site (max over calls)",
    )
    over = [(x, y) for x, y in shown if y > LOG2_MAX and ys[x] < math.inf]
    if over:
        ax.scatter(*zip(*over), s=14, color=_OVER, zorder=3, label="beyond 65504")
    broken = [(x, top) for x, y in enumerate(ys) if y == math.inf]
    if broken:
        ax.scatter(
            *zip(*broken),
            s=40,
            marker="X",
            color="black",
            zorder=4,
            label="inf/NaN already in FP32",
        )


def _draw_limits(ax) -> None:
    """The FP16 limits that fall inside the y range (a line outside it has no legend entry)."""
    low, high = ax.get_ylim()
    for y, style, label in (
        (LOG2_MAX, dict(color=_OVER, ls="--", lw=1), "FP16 max 65504 (2^16)"),
        (LOG2_MIN_NORMAL, dict(color="grey", ls="--", lw=1), "FP16 min normal 2^-14"),
        (LOG2_MIN_SUBNORMAL, dict(color="grey", ls=":", lw=0.8), "FP16 min subnormal 2^-24"),
    ):
        if low <= y <= high:
            ax.axhline(y, label=label, **style)


def label_slots(
    starts: list[tuple[float, int]], n: int, levels: int = 3, char_frac: float = 0.0058
) -> dict[int, tuple[int, str]]:
    """Greedy, worst first: span index -> (label level, "left"/"right" alignment).

    ``starts`` holds (x, label length) per span, in the order of importance; a label that
    would overlap another on every level is left out; near the right edge it ends at x.
    """
    taken: list[list[tuple[float, float]]] = [[] for _ in range(levels)]
    slots = {}
    for i, (x, chars) in enumerate(starts):
        width = char_frac * (chars + 2)
        lo = x / max(n, 1)
        align = "left" if lo + width <= 1 else "right"
        lo, hi = (lo, lo + width) if align == "left" else (lo - width, lo)
        for level in range(levels):
            if all(hi < a or lo > b for a, b in taken[level]):
                taken[level].append((lo, hi))
                slots[i] = (level, align)
                break
    return slots


def _draw_spans(ax, report: Report, pos: dict[str, int], opts: PlotOptions) -> None:
    n = len(pos)
    half = max(0.5, n / 600)  # a span stays visible on a 10,000-site axis
    for i, span in enumerate(report.spans):
        xs = [pos[s] for s in span.sites if s in pos]
        if xs:
            ax.axvspan(
                min(xs) - half,
                max(xs) + half,
                color=_OVER,
                alpha=0.15,
                lw=0,
                label="overflow span" if i == 0 else None,
            )
    worst = sorted(
        (s for s in report.spans if s.start in pos),
        key=lambda s: -(s.peak if not math.isnan(s.peak) else math.inf),
    )
    worst = worst[: opts.span_labels]
    # a character of an 8-point label is ~0.58% of an 11-inch axis: more of a narrower one
    char_frac = 0.0058 * 11.0 / opts.width
    slots = label_slots([(pos[s.start], len(s.start)) for s in worst], n, char_frac=char_frac)
    for i, (level, align) in slots.items():
        x = pos[worst[i].start]
        ax.annotate(  # levels a line of text apart (points), whatever the y range and height
            worst[i].start,
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -3 - 10 * level),
            textcoords="offset points",
            fontsize=8,
            color=_OVER,
            va="top",
            ha=align,
            clip_on=True,
        )


def _draw_internal(ax, report: Report, pos: dict[str, int], top: float) -> None:
    points = [
        (pos[f.site], min(log2_abs(f.peak), top))
        for f in report.findings_by(Mechanism.INTERNAL)
        if f.site in pos
    ]
    if points:
        ax.scatter(
            *zip(*points),
            marker="^",
            s=30,
            color=_INTERNAL,
            zorder=4,
            label="inside an op (internal risk)",
        )


def _draw_parameters(ax, report: Report, pos: dict[str, int], top: float) -> None:
    """Parameter problems at the site that holds the tensor: beyond 65504 at the tensor's
    log2 |max| (clipped to the top), flushed or subnormal weights at their magnitude."""
    low = ax.get_ylim()[0]
    points = []
    for f in report.findings_by(Mechanism.PARAMETER):
        if f.site not in pos:
            continue
        y = log2_abs(f.peak) if f.peak == f.peak else math.inf  # NaN: drawn at the top
        points.append((pos[f.site], min(max(y, low + 0.5), top)))
    if points:
        ax.scatter(
            *zip(*points),
            marker="D",
            s=28,
            facecolors="none",
            edgecolors=_PARAM,
            linewidths=1.3,
            zorder=5,
            label="parameter problem (weights, buffers)",
        )


def _site_ticks(ax, report: Report, pos: dict[str, int], most: int) -> None:
    """Site names on the x axis: every site when few, else an even subset plus the span
    starts (thinned so that labels do not collide)."""
    from matplotlib.ticker import FixedLocator

    n = len(pos)
    names = sorted(pos, key=lambda name: pos[name])
    if n <= most:
        ticks = list(range(n))
    else:
        step = n / most
        ticks = sorted({round(i * step) for i in range(most)})
        for span in report.spans:  # the starts matter most: swap them in for a neighbour
            if span.start in pos:
                x = pos[span.start]
                near = min(ticks, key=lambda t: abs(t - x))
                if abs(near - x) < step / 2:
                    ticks[ticks.index(near)] = x
        ticks = sorted(set(ticks))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticklabels(
        [_short(names[t]) for t in ticks],
        rotation=40,
        ha="right",
        rotation_mode="anchor",
        fontsize=7,
    )


def _short(name: str, width: int = 30) -> str:
    if len(name) <= width:
        return name
    head = (width - 1) // 3
    return name[:head] + "…" + name[len(name) - (width - 1 - head) :]


def _figure(opts: PlotOptions):
    import_optional("matplotlib", "plot", "report.plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    global _ReportFigure
    if _ReportFigure is None:

        class ReportFigure(Figure):
            """A Figure that notebooks display as a picture (``_repr_png_``) without pyplot."""

            def _repr_png_(self) -> bytes:
                buf = io.BytesIO()
                self.savefig(buf, format="png")
                return buf.getvalue()

        ReportFigure.__qualname__ = "ReportFigure"
        _ReportFigure = ReportFigure
    fig = _ReportFigure(figsize=(opts.width, opts.height), dpi=opts.dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


_ReportFigure: type[Any] | None = (
    None  # the Figure subclass, made on first use (matplotlib is optional)
)


def plot(report: Report, path: str | Path | None = None, **options) -> Figure:
    """A matplotlib Figure of log2 |x| per site with the FP16 limits and the spans shaded;
    saved to ``path`` (any format matplotlib writes, by suffix) when given."""
    opts = PlotOptions(**options)
    fig = _figure(opts)
    ax = fig.add_subplot()
    pos, ys = _positions(report)
    low, high = _ylim(ys)
    ax.set_ylim(low, high)
    _draw_limits(ax)
    _draw_sites(ax, ys, high - 3.5)  # inf/NaN drawn just below the span labels
    _draw_spans(ax, report, pos, opts)
    _draw_internal(ax, report, pos, high - 3.5)
    _draw_parameters(ax, report, pos, high - 3.5)
    _decorate(ax, report, pos, opts)
    if path is not None:
        _save(fig, Path(path))
    return fig


def _decorate(ax, report: Report, pos: dict[str, int], opts: PlotOptions) -> None:
    n = len(pos)
    most = max(4, int(opts.width * TICKS_PER_INCH))
    ax.set_xlim(-0.5, max(n, 1) - 0.5)
    if n:
        _site_ticks(ax, report, pos, most)
    thinned = "" if n <= most else f", {len(ax.get_xticks())} named"
    ax.set_xlabel(
        f"site, in execution order ({n} sites{thinned}); spans labelled at their start", fontsize=9
    )
    ax.set_ylabel("log2 |x|")
    ax.set_title(f"{report.meta.model_class or 'model'}: FP16 range per site", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.figure.legend(loc="outside lower center", fontsize=7, ncols=4, frameon=False)


def _save(fig, path: Path) -> None:
    try:
        path.parent.mkdir(
            parents=True, exist_ok=True
        )  # a missing folder is made, as report.save does
        fig.savefig(path)
    except (OSError, ValueError) as exc:
        raise ReportError(
            f"cannot save the plot to {path}: {exc}; choose a writable path with a suffix "
            "matplotlib knows (.png, .svg, .pdf)"
        ) from exc
