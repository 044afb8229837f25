"""The README is short and true: its Python journey runs as written on the built-in demo
model (judged by real FP16, not by fp16lens), the output it shows is what the demo and the
report really print, and every link in it and in docs/ leads to a file."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _shown_lines(block: str) -> list[str]:
    """The lines a README output block claims, without the ones it shortened ("…")."""
    return [line.rstrip() for line in block.splitlines() if line.strip() and "…" not in line]


def test_the_readme_reads_in_two_minutes():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 180
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:4] == [
        "## Two commands",
        "## The 60-second demo",
        "## Using it",
        "## From a terminal",
    ]
    assert "docs/DESIGN.md" in README.read_text(encoding="utf-8")


def test_every_link_leads_to_a_file():
    pages = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_python_journey_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("onnxruntime")
    from fp16lens.demo import build_demo_model

    (code,) = _blocks(_section("Using it"), "python")
    model, (x,) = build_demo_model()
    with torch.no_grad():  # ground truth: the model in real FP16 is broken
        assert not torch.isfinite(copy.deepcopy(model).half()(x.half())).all()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    scope = {"model": model, "batches": [x], "x": x}
    exec(compile(code, "README.md:Using it", "exec"), scope)
    printed = capsys.readouterr().out
    patched = scope["patched"]
    with torch.no_grad():  # the fix, judged by real FP16 again
        assert torch.isfinite(copy.deepcopy(patched).half()(x.half())).all()
    assert (tmp_path / "model.onnx").is_file() and (tmp_path / "report.html").is_file()
    assert bool(scope["result"])
    # the report the README shows under the block is what report.print() printed
    shown = _shown_lines(_blocks(_section("Using it"), "text")[0])
    got = {line.rstrip() for line in printed.splitlines()}
    assert len(shown) > 10 and [line for line in shown if line not in got] == []


@pytest.mark.slow  # the whole demo in a subprocess: about 10 s, more on a loaded machine
def test_the_demo_output_is_the_real_one(tmp_path):
    pytest.importorskip("onnxruntime")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    done = subprocess.run(
        [sys.executable, "-m", "fp16lens", "demo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = {line.rstrip() for line in done.stdout.splitlines()}
    shown = _shown_lines(_blocks(_section("The 60-second demo"), "text")[0])
    assert len(shown) > 10 and [line for line in shown if not _printed(line, got)] == []


_COSINE = re.compile(r"0\.99\d{4}")


def _printed(line: str, got: set[str]) -> bool:
    """``line`` is among ``got``, its 6-decimal cosines within 5e-6 (the last digit of an
    FP16 cosine differs between CPUs: 0.999971 on one, 0.999969 on an AMD EPYC)."""
    if line in got:
        return True
    want = [float(v) for v in _COSINE.findall(line)]
    for other in got:
        if _COSINE.sub("#", other) == _COSINE.sub("#", line) and want:
            have = [float(v) for v in _COSINE.findall(other)]
            if len(have) == len(want) and all(abs(a - b) <= 5e-6 for a, b in zip(have, want)):
                return True
    return False
