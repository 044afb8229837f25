"""The HTML report is a page: a title, the verdict, the plot inline, every site in a table,
nothing fetched from the network; checked as parsed HTML and, where Chromium is
installed, in a real headless browser at 1400 and 800 pixels (its screenshots are kept as
CI artifacts in .ci/artifacts/, not committed; $FP16LENS_ARTIFACTS moves them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import pytest

import sample_reports as samples

ARTIFACTS = Path(__file__).resolve().parents[2] / ".ci" / "artifacts"  # in .gitignore
_URL = re.compile(r"""(?:https?:)?//[\w.-]+\.\w+/""")


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.title = ""
        self._in: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in.append(tag)

    def handle_endtag(self, tag):
        if tag in self._in:
            while self._in.pop() != tag:
                pass

    def handle_data(self, data):
        if self._in and self._in[-1] == "title":
            self.title += data
        self.text.append(data)

    def find(self, tag, **attrs) -> list[dict]:
        return [
            a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items())
        ]


def parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    page.close()
    return page


def _site_names(page: _Page, html: str) -> list[str]:
    body = html[html.index("<tbody>") : html.index("</tbody>")]
    return [re.sub(r"<[^>]+>", "", m) for m in re.findall(r'<td class="name">(.*?)</td>', body)]


def test_the_page_has_a_title_the_verdict_the_spans_and_every_site(tmp_path):
    report = samples.seed_report()
    html = report.save(tmp_path / "r.html").read_text(encoding="utf-8")
    page = parse(html)
    assert html.startswith("<!DOCTYPE html>")
    assert page.title.startswith("fp16lens · TextDetector: 1 overflow span")
    text = "".join(page.text)
    assert "✗ TextDetector: 1 overflow span" in text
    assert "backbone.layer4.1.bn2 → backbone.layer4.1:add" in text  # the span as a path
    assert "fix:" in text and "Parameter problems (1)" in text
    # every site, in execution order, not only the hottest ten
    order = [s.name for s in sorted(report.sites.values(), key=lambda s: s.order)]
    assert _site_names(page, html) == order and len(order) == 16
    assert page.find("table", id="sites") and page.find("input", id="filter")
    # headroom bars are CSS widths (they scale with the window), full for beyond 65504
    widths = [float(w) for w in re.findall(r'<span style="width:([\d.]+)%"></span>', html)]
    assert len(widths) == 16 and max(widths) == 100.0 and 0 < min(widths) < 100


def test_the_plot_is_inline_and_nothing_is_fetched(tmp_path):
    pytest.importorskip("matplotlib")
    import base64
    import io

    from matplotlib.image import imread

    html = samples.all_kinds_report().save(tmp_path / "r.html").read_text(encoding="utf-8")
    page = parse(html)
    imgs = page.find("img")
    assert len(imgs) == 1 and imgs[0]["src"].startswith("data:image/png;base64,")
    pixels = imread(io.BytesIO(base64.b64decode(imgs[0]["src"].split(",", 1)[1])))
    assert pixels.shape[1] > 1000  # a real picture
    assert not _URL.search(html), _URL.search(html)
    assert not page.find("link") and all("src" not in a for t, a in page.tags if t == "script")


def test_without_matplotlib_the_page_says_how_to_get_the_plot(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    html = samples.seed_report().save(tmp_path / "r.html").read_text(encoding="utf-8")
    assert "pip install -e '.[plot]'" in html.replace("&#x27;", "'") and "<img" not in html


def test_ten_thousand_sites_all_in_the_table(tmp_path):
    report = samples.big_report(2_000)
    html = report.save(tmp_path / "big.html").read_text(encoding="utf-8")
    assert html.count('<td class="name">') == 2_000


def test_the_svg_fetches_no_fonts_and_the_txt_is_as_wide_as_its_table(tmp_path):
    report = samples.seed_report()
    for i, s in enumerate(list(report.sites.values())):  # transformer-long names
        s.name = f"model.encoder.layers.{i}.self_attention.output_projection.{s.name}"
    report.sites = {s.name: s for s in report.sites.values()}
    svg = report.save(tmp_path / "r.svg").read_text(encoding="utf-8")
    assert "@font-face" not in svg and not _URL.search(
        svg.replace("http://www.w3.org/2000/svg", "")
    )
    ElementTree.fromstring(svg)
    txt = report.save(tmp_path / "r.txt").read_text(encoding="utf-8")
    table = txt[txt.index("Hottest sites") :].splitlines()
    assert table[1].rstrip().endswith("2^-14 … 2^16")  # the header is whole
    longest = max(len(s.name) for s in report.sites.values())
    assert any(len(line.split()[0]) == longest for line in table[3:])  # names whole


# ---- a real browser ------------------------------------------------------------------------

_PROBE = """<script>window.addEventListener("load", function () {
  var d = document.documentElement, img = document.querySelector("#plot img");
  var bar = document.querySelector("#sites tbody td.barcell");
  var box = document.querySelector("#sites").parentNode;
  var h2 = Array.prototype.map.call(document.querySelectorAll("h2"), function (h) {
    return [h.scrollWidth, h.clientWidth]; });
  var p = document.createElement("pre"); p.id = "probe";
  p.textContent = JSON.stringify({scroll: d.scrollWidth, inner: window.innerWidth,
    img: img ? img.naturalWidth : 0, imgw: img ? img.getBoundingClientRect().width : 0,
    rows: document.querySelectorAll("#sites tbody tr").length, title: document.title,
    bar: bar.getBoundingClientRect().width, h2: h2,
    table: [box.scrollWidth, box.clientWidth]});
  document.body.appendChild(p);
});</script></body>"""


def _chromium() -> str | None:
    return next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )


def _browser(exe: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("width", [1400, 800])
def test_in_a_real_browser_nothing_is_cut(tmp_path, width):
    exe = _chromium()
    if exe is None:
        pytest.skip("needs Chromium: apt-get install -y chromium")
    pytest.importorskip("matplotlib")
    report = samples.long_names(samples.all_kinds_report())
    path = report.save(tmp_path / "r.html")
    probe = tmp_path / "probe.html"
    probe.write_text(path.read_text(encoding="utf-8").replace("</body>", _PROBE), encoding="utf-8")
    done = _browser(
        exe,
        [f"--window-size={width},900", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
    )
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert found, done.stderr[-2000:]
    seen = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert seen["title"].startswith("fp16lens · Everything: 4 overflow spans")
    assert seen["scroll"] <= seen["inner"]  # no horizontal scrolling: nothing cut
    assert all(scroll <= client for scroll, client in seen["h2"])  # headings whole
    assert seen["img"] > 1000 and seen["imgw"] > 0.8 * (width - 64) - 40  # the plot, drawn
    assert seen["rows"] == len(report.sites)
    assert seen["table"][0] <= seen["table"][1]  # the table fits: headroom and bars in view
    assert seen["bar"] > (150 if width == 1400 else 60)  # bars scale with the window
    shot = tmp_path / f"report-{width}.png"
    _browser(exe, [f"--window-size={width},900", f"--screenshot={shot}", path.as_uri()])
    assert shot.is_file() and shot.stat().st_size > 10_000
    artifacts = Path(os.environ.get("FP16LENS_ARTIFACTS") or ARTIFACTS)  # what the browser showed
    artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, artifacts / shot.name)
