"""The README's terminal section runs as written: each command of its first bash block is
run as a user would (`python -m fp16lens ...` in an empty folder) and exits as its
comment says (0, or 1 where it says "exit 1")."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"


def terminal_commands() -> list[tuple[list[str], int]]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## From a terminal") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    out = []
    for line in block.splitlines():
        command, _, comment = line.partition("#")
        if command.strip():
            out.append((shlex.split(command), 1 if "exit 1" in comment else 0))
    return out


def test_the_section_has_the_whole_journey():
    verbs = [argv[1] for argv, _ in terminal_commands()]
    assert {"demo", "scan", "show", "patch", "export", "verify"} <= set(verbs)


@pytest.mark.slow
def test_the_readme_terminal_section_runs_as_written(tmp_path):
    pytest.importorskip("onnxruntime")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    for argv, expected in terminal_commands():
        assert argv[0] == "fp16lens"
        done = subprocess.run(
            [sys.executable, "-m", "fp16lens", *argv[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == expected, f"{shlex.join(argv)}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, done.stderr
    assert (tmp_path / "report.html").is_file() and (tmp_path / "model.onnx").is_file()
