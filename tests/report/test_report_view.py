"""What the terminal view must show, checked on its text (wide console: no wrapping)."""

from __future__ import annotations

import io
import time

import pytest
import rich
from rich.console import Console

from fp16lens._core import ReportError
from fp16lens.report import Finding
from fp16lens.report._blocks import ViewOptions
from fp16lens.report._sections import span_path

import sample_reports as samples


def view(report, width: int = 400, **options) -> str:
    console = Console(
        width=width, color_system=None, force_terminal=False, record=True, file=io.StringIO()
    )
    report.print(console=console, **options)
    return console.export_text()


def section(text: str, title: str) -> str:
    """The lines of one section: from its heading to the next blank line."""
    start = text.index(title)
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else len(text)]


def test_seed_span_reads_as_a_path_through_the_module_tree():
    text = view(samples.seed_report())
    assert (
        "backbone.layer4.1.bn2 → backbone.layer4.1:add → backbone.layer4.1.relu → "
        "neck.reduce_c5.0 → neck.reduce_c5.1 (back in range)"
    ) in text
    assert "peak 2.72e5 (4.2× the FP16 max) at backbone.layer4.1:add" in text


def test_verdict_counts_worst_headroom_and_next_step():
    first, second = view(samples.seed_report()).splitlines()[:2]
    assert first.startswith(
        "✗ TextDetector: 1 overflow span, 0 internal risks, 1 parameter problem"
    )
    assert "worst headroom -2.1 bits" in first and "415% of 65504" in first
    assert second.strip().startswith(
        "Next: rescale by 2^-6 folded into backbone.layer4.1.bn2 parameters"
    )


def test_every_finding_kind_has_its_section_and_fix():
    text = view(samples.all_kinds_report())
    assert text.splitlines()[0].startswith(
        "✗ Everything: 4 overflow spans, 5 internal risks, 5 parameter problems, 2 input problems"
    )
    internal = section(text, "Internal risks (5)")
    assert internal.count("On TensorRT:") == 5
    assert "LayerNorm becomes ReduceMean, Sub, Pow, ReduceMean" in internal
    params = section(text, "Parameter problems (5)")
    for label in ("[beyond 65504 ×8]", "[subnormal ×200]", "[flushed to zero ×5]", "[inf/NaN ×1]"):
        assert label in params
    assert text.count("fix: ") == 4 + 1 + 5 + 5 + 2  # spans, orphan exp, internal, params, inputs


def test_input_problems_are_not_reported_as_model_overflow():
    text = view(samples.all_kinds_report())
    inputs = section(text, "Input problems (2)")
    assert "input[0]" in inputs and "the data is broken, not the model" in inputs
    assert "input[" not in section(text, "Overflow spans (4)")
    # Broken data comes first: nothing downstream can be trusted until it is fixed.
    assert "Next: drop or repair the samples holding inf/NaN (batch 1)" in text


def test_long_span_collapses_its_middle():
    path = span_path(samples.long_span_report(20).spans[0], keep=9).plain
    assert path.startswith("stem → blocks.0.relu → blocks.0.conv → blocks.1.relu → … ")
    assert "… 34 more … → blocks.18.conv → blocks.19.relu → blocks.19.conv → exit" in path
    assert path.count("→") == 8


def test_hottest_sites_show_headroom_and_near_misses():
    text = view(samples.seed_report())
    row = next(line for line in text.splitlines() if line.startswith("neck:add "))
    assert "4.98e4" in row and "76%" in row and "+0.4 bits" in row
    over = next(line for line in text.splitlines() if line.startswith("neck.reduce_c5.0 "))
    assert "128%" in over and over.rstrip().endswith("!")


def test_top_limits_every_part_and_says_how_many_are_hidden():
    text = view(samples.all_kinds_report(), top=2)
    assert "Hottest sites (top 2 of 17)" in text
    assert "… 3 more internal risks: report.print(full=True) shows all" in text
    assert "… 2 more spans: report.print(full=True) shows all" in text


def test_one_hidden_item_is_named_in_the_singular():
    text = view(samples.all_kinds_report(), top=4)
    assert "Internal risks (5)" in text and "Overflow spans (4)" in text
    assert "… 1 more internal risk: report.print(full=True) shows all" in text
    assert "more span" not in text


def test_clean_report_is_one_line():
    lines = view(samples.clean_report()).strip().splitlines()
    assert lines == [
        "✓ CleanNet is FP16-safe: 5 sites in range over 2 batches; worst headroom +14.7 bits "
        "at fc (|x| ≤ 2.5)"
    ]


def test_notes_do_not_make_a_report_unclean():
    report = samples.clean_report()
    report.findings.append(
        Finding(
            site="attn:masked_fill",
            mechanism="note",
            kind="mask-constant",
            peak=float("inf"),
            detail="3 values at |v| >= 1e30 (a masking constant)",
            count=3,
        )
    )
    text = view(report)
    assert text.startswith("✓ CleanNet is FP16-safe") and "1 note below" in text
    assert "torch.finfo(x.dtype).min" in section(text, "Notes (1)")


def test_full_lists_every_site_with_its_numbers():
    report = samples.seed_report()
    rows = section(view(report, full=True), "All sites (16").splitlines()[3:]
    assert [r.split()[0] for r in rows] == list(report.sites)
    assert rows[-1].split() == ["head.conv", "Conv2d", "1", "2.2", "+14.9", "10.0%"]


def test_ten_thousand_sites_render_within_a_second():
    report = samples.big_report(10_000)
    text = view(report, width=100)  # warm up rich's caches
    start = time.perf_counter()
    text = view(report, width=100)
    default = time.perf_counter() - start
    start = time.perf_counter()
    full = view(report, width=100, full=True)
    everything = time.perf_counter() - start
    assert "Hottest sites (top 10 of 10000)" in text and len(text.splitlines()) < 120
    assert len(full.splitlines()) > 10_000
    assert default < 1.0, f"default view took {default:.2f} s"
    assert everything < 2.0, f"full view took {everything:.2f} s"


def test_rich_print_uses_the_same_view(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    out = io.StringIO()
    rich.print(samples.seed_report(), file=out)  # Report.__rich_console__
    assert out.getvalue() == view(samples.seed_report(), width=120)


def test_view_options_are_validated():
    with pytest.raises(ValueError, match="top must be an integer >= 1, got 0"):
        ViewOptions(top=0)
    with pytest.raises(ValueError, match="path_keep"):
        ViewOptions(path_keep=2)
    with pytest.raises(ReportError, match="use one of html, svg, txt"):
        from fp16lens.report._render import export_text

        export_text(samples.clean_report(), "pdf")


def test_an_empty_report_says_what_to_do(tmp_path):
    from fp16lens.report import Report

    assert view(Report()).strip() == (
        "? model: no sites recorded; run the model inside fp16lens.watch(model)"
    )
    assert Report().plot(tmp_path / "empty.png").axes  # still a figure, with the limits


@pytest.mark.parametrize("width", [80, 100])
def test_a_narrow_terminal_keeps_headroom_and_bars_and_shortens_names(width):
    report = samples.seed_report()
    for i, s in enumerate(list(report.sites.values())):  # transformer-long names
        s.name = f"model.encoder.layers.{i}.self_attention.output_projection.{s.name}"
    report.sites = {s.name: s for s in report.sites.values()}
    text = view(report, width=width)
    table = text[text.index("Hottest sites") :].splitlines()
    assert all(len(line) <= width for line in table)
    header, rows = table[1], table[3:13]
    assert "headroom" in header and header.rstrip().endswith("2^-14 … 2^16")
    worst = report.hottest(10)
    for row, site in zip(rows, worst):
        assert row.rstrip().endswith("!" if site.headroom < 0 else ("█", "░"))  # the whole bar
        assert f"{site.headroom:+.1f} bits" in row
        name = row.split()[0]
        assert "…" in name and site.name.endswith(name.split("…")[1])  # its tail kept


def test_wrapped_paragraphs_stay_indented_with_no_trailing_blanks():
    """At 60 columns the spans' paths and fixes wrap: every continuation line keeps the
    indent, and no paragraph line is padded on the right (a log, a pipe, a copied line)."""
    text = view(samples.all_kinds_report(), width=60)
    spans = section(text, "Overflow spans").splitlines()[1:]
    fixes = [i for i, line in enumerate(spans) if line.startswith("    fix: ")]
    assert fixes and any(spans[i + 1].startswith("    ") for i in fixes if i + 1 < len(spans))
    assert all(line == line.rstrip() for line in spans), [ln for ln in spans if ln != ln.rstrip()]
    assert all(len(line) <= 60 for line in spans)
    verdict = text.split("\n\n")[0].splitlines()  # the verdict and its next step
    assert len(verdict) > 2 and all(line == line.rstrip() for line in verdict), verdict


def _mask_note(site: str, count: int = 450) -> Finding:
    return Finding(
        site=site,
        mechanism="note",
        kind="mask-constant",
        peak=3.4e38,
        batch=0,
        count=count,
        detail=f"{count} values at |v| >= 1e30 (a masking constant)",
        fix=f"write the mask constant of {site} as torch.finfo(x.dtype).min",
    )


def test_findings_that_differ_only_by_a_layer_number_share_one_block():
    """Each layer of a transformer masks its attention the same way: one block names them
    all (the heading still counts every finding); a finding that says something else, or
    whose site differs by more than its numbers, keeps its own block."""
    layers = [f"encoder.layer.{i}.attention:where" for i in range(6)]
    notes = [_mask_note(s) for s in layers]
    notes += [_mask_note("decoder.layer.0.attention:where")]  # another skeleton
    notes += [_mask_note("encoder.layer.9.attention:where", count=12)]  # says another count
    rows = [(s, "where", 1.0) for s in [*layers, *(n.site for n in notes[6:])]]
    text = view(samples._report(rows, findings=notes), full=True)
    block = section(text, "Notes (8)")
    assert "[encoder.layer.{0-5}.attention:where · mask-constant] 450 values" in block
    assert "fix: write the mask constant of encoder.layer.{0-5}.attention:where as" in block
    assert "encoder.layer.3.attention" not in block
    assert "[decoder.layer.0.attention:where · mask-constant]" in block
    assert "[encoder.layer.9.attention:where · mask-constant] 12 values" in block
    assert block.count("•") == 3


def test_a_sites_pattern_writes_each_varying_number_once():
    from fp16lens.report._findview import sites_pattern

    assert sites_pattern(["a.0.b", "a.1.b", "a.2.b"]) == "a.{0-2}.b"
    assert sites_pattern(["a.0.b", "a.2.b", "a.7.b"]) == "a.{0,2,7}.b"
    assert sites_pattern(["a.1.b#2", "a.2.b#2"]) == "a.{1,2}.b#2"
