"""The notebooks run top to bottom (nbclient, the venv's python3 kernel), and the files in
git are exactly what scripts/make_notebooks.py writes: no outputs, reproducible."""

from __future__ import annotations

import os
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
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the kernel's tempfile.mkdtemp() lands here
    # the kernel imports this checkout's fp16lens, whatever is installed in the environment
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # nothing is written next to the notebook (no untracked report.json in notebooks/)
    assert not list(cwd.iterdir()), list(cwd.iterdir())
    written = {p.name for p in tmp.glob("fp16lens-*/*")}
    if path.stem.startswith("01"):
        assert {"report.json", "report.html"} <= written
        fig_cell = next(
            c for c in nb.cells if c.cell_type == "code" and "report.plot()" in c.source
        )
        shown = [o for o in fig_cell.outputs if o.output_type in ("display_data", "execute_result")]
        assert shown and "image/png" in shown[-1]["data"], shown  # the picture, not a repr
    if path.stem.startswith("03"):
        assert {"demo_fp16.onnx", "demo_int8.onnx"} <= written
