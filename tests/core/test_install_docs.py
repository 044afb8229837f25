"""Install instructions that work from a clone: every pip line the README, the docs and the
missing-extra errors print names an extra setup.cfg has, in the form that works without
an index (`pip install -e '.[x]'`), and the bootstrap installs numpy before torch is
first imported (else torch prints "Failed to initialize NumPy")."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from fp16lens._core import MissingDependencyError, import_optional

ROOT = Path(__file__).parents[2]
TEXTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "fp16lens").rglob("*.py")),
    *sorted((ROOT / "notebooks").glob("*.ipynb")),
    ROOT / "scripts" / "make_notebooks.py",
]


def _extras() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return set(cfg["options.extras_require"])


def test_no_install_line_asks_an_index_for_fp16lens():
    bad = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in TEXTS
        for m in re.finditer(r"pip install\s+'?fp16lens\[", p.read_text(encoding="utf-8"))
    ]
    assert not bad, bad


def test_every_named_extra_exists():
    named = {
        (p.name, extra)
        for p in TEXTS
        for group in re.findall(r"pip install -e\s+'\.\[([\w,]+)\]'", p.read_text(encoding="utf-8"))
        for extra in group.split(",")
        if extra != "extra"
    }  # a docstring's placeholder
    assert named and {extra for _, extra in named} <= _extras(), named


def test_a_missing_extra_error_gives_the_clone_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError) as info:
        import_optional("matplotlib", "plot", "report.plot")
    assert "pip install -e '.[plot]'" in str(info.value) and "plot" in _extras()


def test_the_notebooks_extra_opens_the_notebooks():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "jupyterlab" in cfg["options.extras_require"]["notebooks"].split()


def test_bootstrap_installs_numpy_before_torch_is_imported():
    lines = (ROOT / "scripts" / "bootstrap.sh").read_text().splitlines()
    code = [i for i, line in enumerate(lines) if not line.lstrip().startswith("#")]
    numpy = next(i for i in code if "pip install" in lines[i] and "numpy" in lines[i])
    torch = next(i for i in code if "import torch" in lines[i])
    assert numpy < torch
