"""The report as a web page: ``report.save("r.html")``.

One self-contained file (no fonts, scripts or images fetched from anywhere, so it opens
offline): a title, the verdict, the plot (a PNG data URI when matplotlib is installed),
each section of the terminal view as wrapping text that follows the window's width, and
every site in a table that can be filtered and sorted, with headroom bars that scale with
the window.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from typing import cast

from rich.console import Console, RenderableType
from rich.text import Text

from fp16lens.report import _findview, _fmt, _sections
from fp16lens.report._blocks import ViewOptions
from fp16lens.report._model import Report, SiteStats

_TEXT_WIDTH = 4000  # rich never wraps; the browser wraps to the window (pre-wrap)

_CSS = """
:root { --red:#c62828; --amber:#b26a00; --green:#2e7d32; --grey:#666; --line:#e3e3e3; }
* { box-sizing: border-box; }
body { margin: 0; padding: 1.2rem 2rem 3rem; font: 15px/1.45 system-ui, -apple-system,
  "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; color: #1d1d1d; background: #fff; }
header h1 { font-size: 1.5rem; margin: 0 0 .2rem; }
.meta { color: var(--grey); margin: 0 0 1rem; }
h2 { font-size: 1.15rem; margin: 1.8rem 0 .5rem; border-bottom: 1px solid var(--line);
  padding-bottom: .2rem; }
h2 small { font-weight: normal; color: var(--grey); font-size: .85rem; margin-left: .6rem; }
.rich { font: 13px/1.5 ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", "Liberation Mono",
  monospace; margin: 0; }
.rich .l { white-space: pre-wrap; overflow-wrap: anywhere; }
.verdict { border-left: 6px solid var(--red); background: #fdf3f3; padding: .6rem .9rem; }
.verdict.clean { border-color: var(--green); background: #f2f8f2; }
figure { margin: 0; }
figure img { width: 100%; max-width: 1600px; height: auto; border: 1px solid var(--line); }
.note { color: var(--grey); }
.tools { display: flex; gap: 1rem; align-items: center; flex-wrap: wrap; margin: .4rem 0; }
.tools input[type=search] { min-width: 18rem; padding: .25rem .4rem; }
.scroll { max-height: 80vh; overflow: auto; border: 1px solid var(--line); }
table.sites { border-collapse: collapse; width: 100%; font-size: 13px; }
table.sites th { position: sticky; top: 0; background: #f6f6f6; text-align: left;
  cursor: pointer; user-select: none; white-space: nowrap; padding: .3rem .5rem;
  border-bottom: 1px solid #ccc; }
table.sites th[aria-sort=ascending]::after { content: " ▲"; }
table.sites th[aria-sort=descending]::after { content: " ▼"; }
table.sites td { padding: .15rem .5rem; border-bottom: 1px solid #f0f0f0; vertical-align: middle; }
table.sites td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.sites td.name { font-family: ui-monospace, Menlo, Consolas, monospace; min-width: 22ch; }
table.sites td.barcell { width: 30%; min-width: 6rem; }
table.sites td.op { max-width: 16ch; overflow-wrap: anywhere; }
@media (max-width: 1100px) { .c-calls, .c-flush { display: none; } }
@media (max-width: 900px) { .c-share, .c-sub { display: none; }
  body { padding: 1rem; } }
.bar { position: relative; height: .8rem; background: #eee; border-radius: 2px; }
.bar > span { position: absolute; left: 0; top: 0; bottom: 0; border-radius: 2px; }
tr.over .bar > span { background: var(--red); }
tr.near .bar > span { background: #f0a020; }
tr.ok .bar > span { background: #5b9b5e; }
tr.over td.name, tr.over td.head { color: var(--red); font-weight: 600; }
tr.inspan td:first-child { box-shadow: inset 4px 0 0 #f3b4b4; }
footer { margin-top: 2rem; color: var(--grey); font-size: .85rem; }
"""

# Filter by name/op, show only sites in spans or near the limit, sort by any column.
_JS = """
(function () {
  var table = document.getElementById("sites"), body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.rows);
  var filter = document.getElementById("filter"), problems = document.getElementById("problems");
  var count = document.getElementById("shown");
  function apply() {
    var q = filter.value.toLowerCase(), only = problems.checked, n = 0;
    rows.forEach(function (r) {
      var show = (!q || r.dataset.key.indexOf(q) >= 0) && (!only || !r.classList.contains("ok"));
      r.style.display = show ? "" : "none"; if (show) n++;
    });
    count.textContent = n;
  }
  filter.addEventListener("input", apply); problems.addEventListener("change", apply);
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
    th.addEventListener("click", function () {
      var asc = th.getAttribute("aria-sort") !== "ascending", num = th.dataset.type === "num";
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (o) { o.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", asc ? "ascending" : "descending");
      rows.sort(function (a, b) {
        var x = a.cells[i].dataset.v || a.cells[i].textContent, y = b.cells[i].dataset.v || b.cells[i].textContent;
        var c = num ? (parseFloat(x) - parseFloat(y)) : x.localeCompare(y);
        return asc ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
  apply();
})();
"""


def _rich_html(renderables: list[RenderableType]) -> str:
    """Renderables as inline-styled HTML (no wrapping: the page wraps them)."""
    console = Console(
        record=True,
        width=_TEXT_WIDTH,
        file=io.StringIO(),
        color_system="truecolor",
        force_terminal=True,
        force_jupyter=False,
        legacy_windows=False,
    )
    for r in renderables:
        console.print(r)
    code = console.export_html(inline_styles=True, code_format="{code}")
    lines = []
    for line in code.strip("\n").splitlines():
        # a line's indent becomes a hanging indent: its wrapped continuation lines align
        body = line.rstrip().lstrip(" ")
        pad = len(line) - len(line.lstrip(" "))
        style = f' style="padding-left:{pad}ch"' if pad else ""
        lines.append(f'<div class="l"{style}>{body or "&nbsp;"}</div>')
    return "\n".join(lines)


def _is_heading(r: RenderableType) -> bool:
    return isinstance(r, Text) and r.plain.startswith("\n") and bool(r.spans)


def _section(parts: list[RenderableType], anchor: str) -> str:
    """One view section (a heading, then its lines) as <section><h2>…</h2><div>…</div>."""
    head, body = cast(Text, parts[0]), parts[1:]  # each section opens with its Text heading
    title, note = head.plain.strip(), ""
    if _is_heading(head):
        first = head.spans[0]
        title = head.plain[first.start : first.end].strip()
        note = head.plain[first.end :].strip()
    small = f" <small>{html.escape(note)}</small>" if note else ""
    return (
        f'<section id="{anchor}"><h2>{html.escape(title)}{small}</h2>\n'
        f'<div class="rich">{_rich_html(body)}</div></section>'
    )


def _sections_of(report: Report, view: ViewOptions) -> list[tuple[str, list[RenderableType]]]:
    """The terminal view's sections but the site tables (the page has its own), in order."""
    out: list[tuple[str, list[RenderableType]]] = []
    if not report.clean:
        out += [
            ("input", _findview.findings(report, view, "input")),
            ("underflow", _findview.findings(report, view, "underflow")),
        ]
    if not report.clean or report.spans:
        out.append(("spans", _sections.spans(report, view)))
    if not report.clean:
        out += [
            ("output", _findview.orphan_outputs(report, view)),
            ("internal", _findview.findings(report, view, "internal")),
            ("parameter", _findview.findings(report, view, "parameter")),
        ]
    out.append(("notes", _findview.findings(report, view, "note")))
    return [(anchor, parts) for anchor, parts in out if parts]


def plot_data_uri(report: Report) -> str | None:
    """The plot as a PNG data URI, or None without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    from fp16lens.report._plot import plot

    fig = plot(report, width=13.0, height=4.6, dpi=110)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _plot_html(report: Report) -> str:
    if not report.sites:
        return ""
    uri = plot_data_uri(report)
    if uri is None:
        body = (
            "<p class=\"note\">The plot needs matplotlib: <code>pip install -e '.[plot]'</code> "
            "in the fp16lens clone, then save the report again.</p>"
        )
    else:
        alt = f"log2 |x| of each of the {len(report.sites)} sites along execution order"
        body = f'<figure><img src="{uri}" alt="{html.escape(alt)}"></figure>'
    return f'<section id="plot"><h2>FP16 range per site</h2>\n{body}</section>'


def _row_class(s: SiteStats, in_span: bool) -> str:
    cls = "over" if s.headroom < 0 else "near" if s.headroom < 1 else "ok"
    return cls + (" inspan" if in_span else "")


def _num(v: float) -> str:
    """A sortable number for data-v (inf and NaN sort last/first as numbers)."""
    if math.isnan(v):
        return "1e999"
    return repr(v) if math.isfinite(v) else ("1e999" if v > 0 else "-1e999")


def _breakable(name: str) -> str:
    """A site name that wraps only after its dots and colons (``<wbr>``), never mid-word."""
    return re.sub(r"([.:])", r"\1<wbr>", html.escape(name))


def _site_rows(report: Report) -> str:
    in_span = {name for span in report.spans for name in span.sites}
    rows = []
    for i, s in enumerate(sorted(report.sites.values(), key=lambda s: s.order)):
        fill = 100.0 * _fmt.bar_fill(s.absmax, 1000) / 1000
        name = _breakable(s.name)
        key = html.escape(f"{s.name} {s.op}".lower(), quote=True)
        rows.append(
            f'<tr class="{_row_class(s, s.name in in_span)}" data-key="{key}">'
            f'<td class="num">{i}</td><td class="name">{name}</td><td class="op">{html.escape(s.op)}</td>'
            f'<td class="num c-calls">{s.calls}</td>'
            f'<td class="num" data-v="{_num(s.absmax)}">{_fmt.value(s.absmax)}</td>'
            f'<td class="num c-share" data-v="{_num(s.absmax)}">{_fmt.share_of_limit(s.absmax)}</td>'
            f'<td class="num head" data-v="{_num(s.headroom)}">{_fmt.bits(s.headroom)}</td>'
            f'<td class="barcell" data-v="{_num(s.absmax)}"><div class="bar" '
            f'title="{_fmt.value(s.absmax)} of 65504"><span style="width:{fill:.1f}%"></span></div></td>'
            f'<td class="num c-sub" data-v="{s.subnormal_share!r}">{100 * s.subnormal_share:.1f}%</td>'
            f'<td class="num c-flush" data-v="{s.underflow_share!r}">{100 * s.underflow_share:.1f}%</td>'
            "</tr>"
        )
    return "\n".join(rows)


_COLUMNS = (
    ("#", "num", ""),
    ("site", "text", ""),
    ("op", "text", ""),
    ("calls", "num", "c-calls"),
    ("absmax", "num", ""),
    ("of 65504", "num", "c-share"),
    ("headroom (bits)", "num", ""),
    ("2^-14 … 65504 (log2)", "num", ""),
    ("subnormal", "num", "c-sub"),
    ("flushed", "num", "c-flush"),
)


def _sites_html(report: Report) -> str:
    if not report.sites:
        return ""
    n = len(report.sites)
    heads = "".join(
        f'<th data-type="{t}" class="{cls}">{html.escape(c)}</th>' for c, t, cls in _COLUMNS
    )
    return (
        f'<section id="sites"><h2>All sites ({n})<small>execution order; click a column to '
        "sort; red: beyond 65504, amber: within one doubling of it, a red edge: inside a span"
        "</small></h2>\n"
        '<div class="tools"><input id="filter" type="search" placeholder="filter by site or op">'
        '<label><input id="problems" type="checkbox"> only sites near or beyond the limit</label>'
        f'<span class="note"><span id="shown">{n}</span> of {n} shown</span></div>\n'
        f'<div class="scroll"><table class="sites" id="sites">'
        f"<thead><tr>{heads}</tr></thead>\n<tbody>\n{_site_rows(report)}\n</tbody></table></div>"
        f"</section>\n<script>{_JS}</script>"
    )


def page(report: Report, view: ViewOptions) -> str:
    """The whole page (a string of HTML)."""
    name = report.meta.model_class or "model"
    verdict = _sections.verdict(report)
    verdict_text = verdict.plain if isinstance(verdict, Text) else _rich_console_text(verdict)
    title = f"fp16lens · {verdict_text.splitlines()[0].lstrip('✓✗? ')}"  # starts with the name
    meta = [
        _fmt.plural(len(report.sites), "site"),
        _fmt.plural(report.meta.batches, "batch", "batches"),
        f"limit {_fmt.limit(report)}",
    ]
    if report.meta.torch_version:
        meta.append(f"torch {report.meta.torch_version}")
    if report.meta.fp16lens_version:
        meta.append(f"fp16lens {report.meta.fp16lens_version}")
    sections = "\n".join(_section(parts, anchor) for anchor, parts in _sections_of(report, view))
    clean = " clean" if report.clean else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<header><h1>fp16lens report · {html.escape(name)}</h1>
<p class="meta">{html.escape(" · ".join(meta))}</p></header>
<section id="verdict"><div class="rich verdict{clean}">{_rich_html([verdict])}</div></section>
{_plot_html(report)}
{sections}
{_sites_html(report)}
<footer>Made by fp16lens. The data is in the report's JSON (<code>report.save("r.json")</code>);
this page needs no network.</footer>
</body>
</html>
"""


def _rich_console_text(renderable: RenderableType) -> str:
    console = Console(width=_TEXT_WIDTH, file=io.StringIO(), color_system=None, record=True)
    console.print(renderable)
    return console.export_text()
