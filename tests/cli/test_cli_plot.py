"""`fp16lens scan MODEL --save r.png`: the report's plot from the terminal (matplotlib),
checked before the watch so that a missing matplotlib costs no scan."""

from __future__ import annotations

import sys

import pytest

from fp16lens.cli import main


def test_scan_saves_the_plot_beside_the_report(capsys, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    png, pdf, page = tmp_path / "r.png", tmp_path / "plots" / "r.pdf", tmp_path / "r.html"
    code = main(
        [
            "scan",
            "models:functional_mul",
            "--save",
            str(png),
            "--save",
            str(pdf),
            "--save",
            str(page),
            "--json",
        ]
    )
    capsys.readouterr()
    assert code == 0
    pixels = image.imread(png)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 600  # a picture, not a stub
    assert pdf.read_bytes().startswith(b"%PDF") and "<title>" in page.read_text()


def test_a_plot_without_matplotlib_is_refused_before_the_scan(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    watched = []
    monkeypatch.setattr("fp16lens.cli._cmd_scan.watch_batches", lambda *a, **k: watched.append(1))
    code = main(["scan", "models:functional_mul", "--save", str(tmp_path / "r.png")])
    err = capsys.readouterr().err
    assert code == 2 and not watched
    assert "pip install -e '.[plot]'" in err and "--save" in err
    assert not (tmp_path / "r.png").exists()


def test_an_unknown_picture_suffix_names_the_ones_that_work(capsys, tmp_path):
    code = main(["scan", "models:functional_mul", "--save", str(tmp_path / "r.jpg")])
    err = capsys.readouterr().err
    assert code == 2 and ".png" in err and ".html" in err
