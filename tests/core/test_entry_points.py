"""The entry points are typed: ``fp16lens.watch``/``patch``/``export``/``verify`` are their
stage packages *and* their main function, with that function's signature for
``inspect``, IDEs and mypy; the README's and the docs' Python pass mypy as written."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fp16lens
from fp16lens.export import export as export_fn
from fp16lens.patch import patch as patch_fn
from fp16lens.patch import plan as plan_fn
from fp16lens.verify import verify as verify_fn
from fp16lens.watch import scan as scan_fn
from fp16lens.watch import watch as watch_fn

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"

STAGES = {"watch": watch_fn, "patch": patch_fn, "export": export_fn, "verify": verify_fn}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_a_stage_has_its_functions_signature_and_stays_a_package(name):
    entry, fn = getattr(fp16lens, name), STAGES[name]
    assert inspect.signature(entry) == inspect.signature(fn)
    assert next(iter(inspect.signature(entry).parameters)) == "model"
    assert entry is sys.modules[f"fp16lens.{name}"]  # the package itself
    assert getattr(entry, name) is fn
    # every public name of the package is reachable from the callable
    assert all(getattr(entry, public) is not None for public in entry.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        entry.nope


def test_plain_functions_keep_their_own_signature():
    assert fp16lens.scan is scan_fn and fp16lens.plan is plan_fn
    assert list(inspect.signature(fp16lens.plan).parameters)[:2] == ["model", "report"]
    assert list(inspect.signature(fp16lens.scan).parameters)[:2] == ["model", "batches"]


def test_what_users_try_resolves():
    from fp16lens.patch import PatchOptions
    from fp16lens.watch import WatchOptions

    assert fp16lens.watch.WatchOptions is WatchOptions is fp16lens.WatchOptions
    assert fp16lens.watch.scan is fp16lens.scan
    assert fp16lens.patch.PatchOptions is PatchOptions is fp16lens.PatchOptions
    assert fp16lens.patch.plan is fp16lens.plan and fp16lens.patch.get_plan is fp16lens.get_plan
    assert fp16lens.export.ExportOptions is fp16lens.ExportOptions
    assert fp16lens.verify.Tolerance is fp16lens.Tolerance
    # submodules import through the callable package (broken while watch was a function)
    import fp16lens.export._export as export_module
    import fp16lens.watch._options as options_module

    assert options_module.WatchOptions is WatchOptions and export_module.export is export_fn
    assert fp16lens.watch.WatchOptions(threshold=2.0).threshold == 2.0


def test_the_readme_demo_model_line_runs_after_a_plain_import():
    # the README: `model, (x,) = fp16lens.demo.build_demo_model()` after `import fp16lens`,
    # in a fresh interpreter (this one may have imported fp16lens.demo already)
    code = (
        "import fp16lens, sys; model, (x,) = fp16lens.demo.build_demo_model(); "
        "print(type(model).__name__, tuple(x.shape)); "
        "sys.exit(0 if 'fp16lens.demo' in sys.modules else 3)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("DemoTextDetector")
    with pytest.raises(AttributeError, match="nosuch"):
        _ = fp16lens.nosuch


def test_the_stage_callables_run():
    import copy

    import torch

    from models import relu_span

    model, (x,) = relu_span()
    with torch.no_grad():
        assert not torch.isfinite(copy.deepcopy(model).half()(x.half())).all()  # real FP16
    with fp16lens.watch(model) as lens:
        model(x)
    patched = fp16lens.patch(model, lens.report, batches=[x])
    assert (plan := fp16lens.get_plan(patched)) is not None and plan.proven
    with torch.no_grad():
        assert torch.isfinite(copy.deepcopy(patched).half()(x.half())).all()
    assert fp16lens.verify(model, patched, [(x,)], backend="torch-fp16")


def test_py_typed_ships():
    assert (ROOT / "fp16lens" / "py.typed").is_file()
    setup = (ROOT / "setup.cfg").read_text()
    assert re.search(r"\[options\.package_data\]\s*\nfp16lens\s*=\s*py\.typed", setup)


# ---- mypy on the README's Python ---------------------------------------------------------

# The snippets use names a user has: a model, its inputs, its batches, a report.
PRELUDE = """\
import torch
import fp16lens

model: torch.nn.Module = torch.nn.Linear(2, 2)
x = torch.ones(1, 2)
batches: list[torch.Tensor] = [x]
loader = batches
inputs = batches
report = fp16lens.Report()
patched: torch.nn.Module = model
"""

# The README and the guides in docs/ (each page checked as one script, blocks in order).
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def page_python(page: Path) -> str | None:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    if not blocks:
        return None
    return PRELUDE + "\n".join(
        f"\n# --- {page.name} python block {i}\n"
        + "\n".join(line for line in block.splitlines() if line.strip() != "import fp16lens")
        for i, block in enumerate(blocks, 1)
    )


def _mypy(paths: list[Path], cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "setup.cfg"),
            "--cache-dir",
            str(cache),
            "--no-error-summary",
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory) -> Path:
    """One mypy cache for both runs: the second reads torch's and numpy's analysis from it."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_readme_and_docs_python_pass_mypy(tmp_path, mypy_cache):
    pytest.importorskip("mypy", reason="pip install -e '.[test]' (or mypy==1.18.2)")
    scripts = []
    for page in PAGES:
        text = page_python(page)
        if text:
            scripts.append(tmp_path / f"{page.stem.lower()}_snippets.py")
            scripts[-1].write_text(text)
    assert any(p.name == "readme_snippets.py" for p in scripts) and len(scripts) >= 3
    done = _mypy(scripts, mypy_cache)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_sees_the_entry_points_signatures(tmp_path, mypy_cache):
    """The check can fail: a wrong call of each entry point is an error mypy reports."""
    pytest.importorskip("mypy", reason="pip install -e '.[test]' (or mypy==1.18.2)")
    bad = tmp_path / "bad.py"
    bad.write_text(
        PRELUDE
        + (
            "fp16lens.patch(model)\n"
            "fp16lens.export(model, (x,))\n"
            "fp16lens.verify(model)\n"
            "fp16lens.watch(model, threshold='high')\n"
            "fp16lens.patch.plan(model, 3)\n"
            "fp16lens.watch.WatchOptions(threshold='high')\n"
            "n: int = fp16lens.verify(model, model, batches)\n"
        )
    )
    done = _mypy([bad], mypy_cache)
    lines = {int(m.group(1)) for m in re.finditer(r"bad\.py:(\d+): error", done.stdout)}
    first = PRELUDE.count("\n") + 1
    assert lines == set(range(first, first + 7)), done.stdout + done.stderr
