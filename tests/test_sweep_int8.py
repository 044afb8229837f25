"""scripts/sweep_int8_shipped.py: a row is the public INT8 export of a shipped model with
its own check on held-out items, and a name it does not know is one line and exit 2."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
sweep = importlib.import_module("sweep_int8_shipped")


def test_an_unknown_row_is_one_line_and_exit_2(capsys):
    assert sweep.main(["aecmos", "no-such-model"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "no-such-model" in err and "aecmos" in err and "layout" in err


def test_aecmos_row_is_the_export_checked_on_the_other_speaker():
    """AECMOS (a CNN and a GRU over three mel spectrograms): all in INT8, verify's check on
    the held-out calls passes, and the written file's scores sit within 0.05 MOS of FP32's
    (the sweep's row in docs/int8.md)."""
    line = sweep.row("aecmos", sweep.ROWS["aecmos"])
    if "not run: " in line:  # the speechmos wheel is missing (zoo_real.Missing)
        pytest.skip(line)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[0] == "aecmos" and cells[1].startswith("passed, cosine 0.9999"), line
    assert cells[2] == "100.0%", line
    error = float(cells[3].split("MOS error ")[1].split(";")[0])
    assert 0 < error < 0.05, line


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--target", "high", "v6s-det"], "--target needs the task metric's threshold"),
        (["--target", "0.98", "magika"], "not magika"),
    ],
)
def test_a_target_the_sweep_cannot_take_is_one_line_and_exit_2(capsys, argv, said):
    """``--target`` reads a number, and only on the rows whose task metric it reads."""
    assert sweep.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and said in err, err
