"""The terminal view against golden files (Rich's own tests/test_table.py style).

Regenerate after an intended change with: FP16LENS_UPDATE_GOLDEN=1 pytest tests/report
and read the diff before committing it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

import sample_reports as samples

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("FP16LENS_UPDATE_GOLDEN") == "1"


def render_plain(report, **options) -> str:
    console = Console(
        width=100, color_system=None, force_terminal=False, record=True, file=io.StringIO()
    )
    report.print(console=console, **options)
    # Trailing blanks are padding, invisible and stripped by editors: not part of the view.
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


CASES = {
    "seed_case": samples.seed_report,
    "clean": samples.clean_report,
    "all_kinds": samples.all_kinds_report,
    "long_span": samples.long_span_report,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_terminal_view_matches_golden(name):
    text = render_plain(CASES[name]())
    path = GOLDEN / f"{name}.txt"
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden file {path}; create it with FP16LENS_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8")


def test_full_view_matches_golden():
    text = render_plain(samples.seed_report(), full=True)
    path = GOLDEN / "seed_case_full.txt"
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")
