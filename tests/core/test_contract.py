"""The shared contract: one error class per stage in _core, the version in _core, finding
kinds and mechanisms as _core.sites enums that survive JSON, stages reading each other
through public names only."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fp16lens
from fp16lens import _core
from fp16lens._core.sites import FindingKind, Mechanism
from fp16lens.report import MECHANISMS, Report

import models

PACKAGE = Path(fp16lens.__file__).parent
STAGES = ("report", "_trace", "watch", "patch", "export", "verify", "cli", "demo")
# Private imports across stages still to go, in modules other refactors own (issue #17).
KNOWN_PRIVATE: set[tuple[str, str]] = set()  # every stage uses the others' public names only


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_each_stage_error_lives_in_core_and_is_the_public_one():
    for name in (
        "WatchError",
        "ReportError",
        "PatchError",
        "ExportError",
        "VerifyError",
        "OutputPathError",
        "StaleReportError",
        "MissingDependencyError",
    ):
        assert issubclass(getattr(_core, name), _core.Fp16LensError), name
    assert fp16lens.export.ExportError is _core.ExportError
    assert issubclass(_core.OutputPathError, OSError)


def test_verify_names_a_candidate_with_other_output_shapes():
    torch.manual_seed(0)
    model, other = nn.Linear(4, 2).eval(), nn.Linear(4, 3).eval()
    with pytest.raises(_core.VerifyError, match="output shapes differ"):
        fp16lens.verify(model, other, (torch.randn(2, 4),), backend="torch-fp16")
    with pytest.raises(_core.VerifyError, match="inputs must be"):
        fp16lens.verify(model, model, "x.pt", backend="torch-fp16")


def test_version_has_one_static_home():
    tree = ast.parse((PACKAGE / "_core" / "version.py").read_text())
    values = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and n.targets[0].id == "__version__"
    ]
    assert values == [fp16lens.__version__]
    assert '"' not in "".join(
        line
        for line in (PACKAGE / "__init__.py").read_text().splitlines()
        if "__version__ =" in line
    )


def test_stages_import_each_other_by_public_names_only():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for module in _imports(path):
            parts = module.split(".")
            if module == "fp16lens" and rel != "__init__.py":
                found.add((rel, module))  # an upward import of the package root
            elif (
                len(parts) > 2
                and parts[0] == "fp16lens"
                and parts[1] in STAGES
                and parts[1] != rel.split("/")[0]
                and parts[2].startswith("_")
            ):
                found.add((rel, module))
    assert found <= KNOWN_PRIVATE, sorted(found - KNOWN_PRIVATE)


def _layers() -> dict[str, int]:
    """The layer table of docs/DESIGN.md: package (``_core``, ``report``, ...) -> layer."""
    table = {}
    for line in (PACKAGE.parent / "docs" / "DESIGN.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for name in cells[1].replace("`", "").split(","):
                table[name.strip().removeprefix("fp16lens.")] = int(cells[0])
    return table


def _all_imports(path: Path):
    """Every absolute import of fp16lens in the file, at module level or inside functions."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_stages_import_only_earlier_layers():
    """No stage imports a stage of its own layer or a later one (the table in DESIGN.md)."""
    layers = _layers()
    assert {
        "_core",
        "report",
        "_trace",
        "watch",
        "patch",
        "export",
        "verify",
        "cli",
        "demo",
    } <= set(layers)
    top = [p.name for p in PACKAGE.iterdir() if (p.is_dir() and (p / "__init__.py").exists())]
    assert set(top) <= set(layers), set(top) - set(layers)  # every package has its layer
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        if len(rel) < 2:  # the package root imports everything
            continue
        here = rel[0]
        for module in _all_imports(path):
            parts = module.split(".")
            if parts[0] != "fp16lens" or len(parts) < 2 or parts[1] == here:
                continue
            if parts[1] not in layers or layers[parts[1]] >= layers[here]:
                wrong.append(f"{'/'.join(rel)} imports {module}")
    assert wrong == []


def test_finding_kinds_and_mechanisms_survive_json():
    model, inputs = models.layernorm_variance()
    report = fp16lens.scan(model, [inputs])
    internal = [f for f in report.findings if f.kind == FindingKind.NORM_VARIANCE]
    assert internal and internal[0].mechanism == Mechanism.INTERNAL
    data = json.loads(report.to_json())
    assert {"norm-variance"} <= {f["kind"] for f in data["findings"]}
    assert {"internal"} <= {f["mechanism"] for f in data["findings"]}
    again = Report.from_dict(data)
    assert again.findings == report.findings
    assert again.findings_by(Mechanism.INTERNAL) == report.findings_by("internal")
    assert MECHANISMS == ("output", "internal", "parameter", "input", "underflow", "note")
