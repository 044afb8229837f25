"""The notebooks run top to bottom (nbclient, the venv's python3 kernel), and the files in
git are exactly what scripts/make_notebooks.py writes: no outputs, reproducible."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def test_notebooks_are_generated_and_stripped():
    assert [p.name for p in NOTEBOOKS] == [
        "01_find_overflow.ipynb",
        "02_fix_and_verify.ipynb",
        "03_deploy.ipynb",
    ]
    check = [sys.executable, str(ROOT / "scripts" / "make_notebooks.py"), "--check"]
    assert subprocess.run(check, capture_output=True, text=True).returncode == 0
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), path.name
        assert not any("torchvision" in c.source for c in code), path.name


@pytest.mark.slow  # a kernel start, torch's import and the journey: 15-40 s each
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if path.stem.startswith("01"):
        assert (tmp_path / "report.json").is_file() and (tmp_path / "report.html").is_file()
    if path.stem.startswith("03"):
        assert (tmp_path / "demo_fp16.onnx").is_file() and (tmp_path / "demo_int8.onnx").is_file()
