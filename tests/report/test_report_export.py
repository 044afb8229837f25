"""HTML, SVG and text exports and the notebook display, parsed back and read."""

from __future__ import annotations

from html.parser import HTMLParser
from xml.etree import ElementTree

from fp16lens.report._render import export_text, mimebundle

import sample_reports as samples


class _TextOf(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self.styles: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.styles += [v for k, v in attrs if k == "style" and v]

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> _TextOf:
    parser = _TextOf()
    parser.feed(html)
    parser.close()
    return parser


def test_html_file_holds_the_view_with_colours(tmp_path):
    path = samples.seed_report().save(tmp_path / "r.html")
    page = parse(path.read_text(encoding="utf-8"))
    text = "".join(page.text)
    assert {"html", "head", "title", "body", "table"} <= set(page.tags)
    assert "✗ TextDetector: 1 overflow span" in text
    assert "backbone.layer4.1.bn2 → backbone.layer4.1:add" in text
    assert "All sites (16)" in text  # the page's table holds every site (test_report_html.py)
    assert any("color" in s for s in page.styles)  # red spans, green fixes: styled inline


def test_txt_and_svg_exports(tmp_path):
    report = samples.all_kinds_report()
    txt = report.save(tmp_path / "r.txt").read_text(encoding="utf-8")
    assert txt == export_text(report, "txt")
    assert "Input problems (2)" in txt and "\x1b[" not in txt
    assert max(len(line) for line in txt.splitlines()) <= 100
    svg = ElementTree.fromstring(report.save(tmp_path / "r.svg").read_text(encoding="utf-8"))
    assert svg.tag.endswith("svg")
    words = " ".join(t for t in svg.itertext())
    assert "Everything" in words


def test_export_width_and_view_options_pass_through():
    text = export_text(samples.big_report(2_000), "txt", width=160, top=3)
    assert "Hottest sites (top 3 of 2000)" in text
    assert max(len(line) for line in text.splitlines()) <= 160


def test_notebook_bundle_has_html_and_plain_text():
    bundle = samples.seed_report()._repr_mimebundle_()
    assert set(bundle) == {"text/html", "text/plain"}
    page = parse(bundle["text/html"])
    assert page.tags[0] == "pre" and "html" not in page.tags  # a fragment, not a page
    assert "".join(page.text).strip() == bundle["text/plain"].strip()
    assert bundle == mimebundle(samples.seed_report())
