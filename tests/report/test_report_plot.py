"""report.plot(): a PNG that decodes, with the FP16 limits, the spans shaded and labelled."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from fp16lens import MissingDependencyError
from fp16lens.report._plot import PlotOptions, label_slots

import sample_reports as samples

matplotlib_image = pytest.importorskip("matplotlib.image")


def test_png_decodes_with_the_requested_size(tmp_path):
    path = tmp_path / "r.png"
    samples.seed_report().plot(path, width=8.0, height=3.0, dpi=50)
    pixels = matplotlib_image.imread(path)
    assert pixels.shape[:2] == (150, 400)
    # The span is shaded in light red: such pixels exist, and only inside the axes.
    reddish = (pixels[..., 0] > 0.95) & (pixels[..., 1] < 0.93) & (pixels[..., 2] < 0.93)
    assert reddish.sum() > 200


def test_axes_hold_limits_sites_spans_and_labels():
    report = samples.all_kinds_report()
    ax = report.plot().axes[0]
    low = ax.get_ylim()[0]
    levels = sorted(
        round(line.get_ydata()[0], 3) for line in ax.lines if len(line.get_ydata()) == 2
    )
    # 2^-24 is below this report's y range: not drawn, and so not in the legend
    assert low > -24 and levels == [-14.0, round(math.log2(65504), 3)]
    curve = next(line for line in ax.lines if len(line.get_xdata()) > 2)
    assert len(curve.get_xdata()) == len(report.sites)  # every site, none dropped
    np.testing.assert_allclose(curve.get_ydata()[0], math.log2(76546.0))
    shaded = [p for p in ax.patches if p.get_alpha() == pytest.approx(0.15)]
    assert len(shaded) == len(report.spans)
    labels = {t.get_text() for t in ax.texts}
    assert labels == {s.start for s in report.spans}
    assert ax.get_xaxis().get_label().get_text().startswith("site, in execution order (17 sites)")


def test_x_axis_names_the_sites_and_the_legend_matches_what_is_drawn():
    report = samples.all_kinds_report()
    fig = report.plot()
    ax = fig.axes[0]
    order = sorted(report.sites.values(), key=lambda s: s.order)
    assert [t.get_text() for t in ax.get_xticklabels()] == [s.name for s in order]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "FP16 min subnormal 2^-24" not in legend and "FP16 max 65504 (2^16)" in legend
    drawn_labels = {a.get_label() for a in [*ax.lines, *ax.collections, *ax.patches]}
    assert set(legend) <= drawn_labels


def test_parameter_problems_are_drawn_at_their_sites():
    report = samples.all_kinds_report()
    ax = report.plot().axes[0]
    x_of = {s.name: i for i, s in enumerate(sorted(report.sites.values(), key=lambda s: s.order))}
    marks = next(c for c in ax.collections if c.get_label().startswith("parameter problem"))
    xs = sorted(int(x) for x, _ in marks.get_offsets())
    want = sorted(x_of[f.site] for f in report.findings_by("parameter"))
    assert xs == want and len(want) >= 4  # beyond 65504, NaN, subnormal and flushed tensors
    ys = {int(x): y for x, y in marks.get_offsets()}
    np.testing.assert_allclose(ys[x_of["enc.conv"]], math.log2(70000.0))  # its max, exactly


def test_two_hundred_layers_stay_readable(tmp_path):
    report = samples.big_report(n=600, spans=12)
    ax = report.plot(tmp_path / "big.png").axes[0]
    names = [t.get_text() for t in ax.get_xticklabels()]
    assert 10 <= len(names) <= 11 * 2.2  # thinned to what 11 inches hold
    assert set(names) <= set(report.sites)  # site names, not indices
    starts = {s.start for s in report.spans}
    assert len(starts & set(names)) >= len(starts) // 2  # span starts are preferred ticks
    assert 0 < len(ax.texts) <= PlotOptions().span_labels  # the worst spans, labelled


def test_the_figure_shows_itself_in_a_notebook():
    """Jupyter displays an object with _repr_png_ as a picture (no pyplot needed)."""
    fig = samples.seed_report().plot(width=6.0, height=3.0, dpi=40)
    png = fig._repr_png_()
    assert png.startswith(b"\x89PNG")
    import io

    assert matplotlib_image.imread(io.BytesIO(png)).shape[:2] == (120, 240)


def test_label_slots_never_overlap_on_one_level():
    starts = [(100, 20), (105, 20), (110, 20), (115, 20), (500, 10), (990, 30)]
    slots = label_slots(starts, n=1000, levels=3)
    # The 4th has no free level; far ones share level 0; the last ends at its x.
    assert slots == {
        0: (0, "left"),
        1: (1, "left"),
        2: (2, "left"),
        4: (0, "left"),
        5: (0, "right"),
    }


def test_plot_options_are_validated():
    with pytest.raises(ValueError, match="dpi must be an integer >= 20"):
        samples.clean_report().plot(dpi=5)


def test_plot_never_touches_pyplot(monkeypatch):
    # pyplot's global state (current figure, GUI backend) must stay untouched: importing
    # it would fail here. tests/core/test_packaging.py checks `import fp16lens` leaves
    # matplotlib unimported.
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    fig = samples.seed_report().plot()
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an absent package looks like
    with pytest.raises(MissingDependencyError, match=r"pip install -e '\.\[plot\]'"):
        samples.clean_report().plot()


@pytest.mark.parametrize("size", [{}, {"width": 8.0, "height": 3.0}])
def test_span_labels_never_overlap_as_drawn(size):
    """Levels are a line of text apart in points, so labels on neighbouring levels do not
    overlap however tall the y range is (they did in a short plot: 1.3 log2 units apart)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = samples.long_names(samples.all_kinds_report()).plot(**size)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in fig.axes[0].texts]
    assert len(boxes) >= 3
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
