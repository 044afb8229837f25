"""The documentation site (mkdocs.yml, docs/): it builds with ``mkdocs build --strict`` (a
broken link, reference, nav entry or docstring fails), every public name is in the API
reference with a docstring, and the CLI reference is what the command's ``--help`` prints.
Needs the ``docs`` extra (MkDocs, Material, mkdocstrings); skipped with the pip line without it."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
STAGES = ("watch", "report", "patch", "export", "verify")
_PIP = "needs the docs extra: pip install -e '.[docs]'"


def _need(*modules: str) -> None:
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a dotted name whose parent is missing
            found = False
        if not found:
            pytest.skip(_PIP)


def _hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts/mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the API reference -------------------------------------------------------------------


def _directives(page: Path) -> list[str]:
    """The objects a page renders with mkdocstrings (``::: path``)."""
    return re.findall(r"^::: ([\w.]+)\s*$", page.read_text(encoding="utf-8"), re.M)


def _griffe_package():
    import griffe

    return griffe.load("fp16lens", search_paths=[str(ROOT)], resolve_aliases=True)


def _member(package, path: str):
    obj = package
    for part in path.split(".")[1:]:
        obj = obj.members[part]
    return obj


def missing_from_reference(public: dict[str, list[str]], pages: dict[str, list[str]]) -> list[str]:
    """Public names (module -> its ``__all__``) that the reference pages (page -> the
    paths it renders) do not render: a stage's names on its own page, the root's names
    rendered on the index page or, for a name re-exported from a stage, on that stage's page
    (the index page's table names it)."""
    rendered = {path for paths in pages.values() for path in paths}
    missing = []
    for module, names in public.items():
        for name in names:
            if f"{module}.{name}" in rendered:
                continue
            if module == "fp16lens" and any(
                f"fp16lens.{stage}.{name}" in rendered for stage in STAGES
            ):
                continue
            missing.append(f"{module}.{name}")
    return missing


def undocumented(package, paths: list[str]) -> list[str]:
    """The paths whose object (followed through imports) has no docstring of its own."""
    return [p for p in paths if not _doc(package, p)]


def _doc(package, path: str) -> str:
    docstring = _member(package, path).docstring
    return docstring.value.strip() if docstring else ""


def _public() -> dict[str, list[str]]:
    modules = ["fp16lens", *(f"fp16lens.{s}" for s in STAGES)]
    return {m: list(importlib.import_module(m).__all__) for m in modules}


def _pages() -> dict[str, list[str]]:
    return {page.name: _directives(page) for page in sorted(API.glob("*.md"))}


def test_every_public_name_is_rendered_in_the_api_reference():
    public, pages = _public(), _pages()
    assert missing_from_reference(public, pages) == []
    # each stage's page renders its names in __all__'s order, and nothing that is not public
    for stage in STAGES:
        assert pages[f"{stage}.md"] == [
            f"fp16lens.{stage}.{n}" for n in public[f"fp16lens.{stage}"]
        ]
    index = (API / "index.md").read_text(encoding="utf-8")
    for name in public["fp16lens"]:  # the root's table names every one of its names
        assert f"| `{name}` |" in index, name
    # a new public name, not yet on a page, is caught
    public["fp16lens.patch"].append("brand_new_function")
    assert missing_from_reference(public, pages) == ["fp16lens.patch.brand_new_function"]


def test_every_public_name_has_a_docstring():
    _need("griffe")
    package = _griffe_package()
    paths = [f"{m}.{n}" for m, names in _public().items() for n in names]
    assert len(paths) > 100
    assert undocumented(package, paths) == []
    # a dataclass without a docstring of its own is caught (Python would make one for it)
    plan = _member(package, "fp16lens.patch.Plan").target
    kept = plan.docstring
    try:
        plan.docstring = None
        assert undocumented(package, paths) == ["fp16lens.Plan", "fp16lens.patch.Plan"]
    finally:
        plan.docstring = kept


# ---- the CLI reference ---------------------------------------------------------------------


def _help(argv: list[str]) -> str:
    from fp16lens.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--help"]) == 0
    return out.getvalue()


def test_the_cli_reference_is_what_help_prints(monkeypatch):
    hooks = _hooks()
    page = hooks.cli_reference()
    monkeypatch.setenv("COLUMNS", hooks.HELP_WIDTH)
    from fp16lens.cli._parser import build_parser

    commands = list(hooks.subcommands(build_parser()))
    assert commands == ["demo", "scan", "show", "patch", "export", "verify"]
    for argv in ([], *([c] for c in commands)):
        assert f"```text\n{_help(argv).rstrip()}\n```" in page, argv
        assert f"## {' '.join(['fp16lens', *argv])}\n" in page


# ---- the site ------------------------------------------------------------------------------


def test_the_site_builds_in_strict_mode(tmp_path):
    _need("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # the made pages, the API pages with an anchor per public name, the figure
    cli = (site / "reference/cli/index.html").read_text(encoding="utf-8")
    assert "fp16lens scan" in cli and "--fail-on" in cli
    for stage in STAGES:
        html = (site / f"api/{stage}/index.html").read_text(encoding="utf-8")
        for name in importlib.import_module(f"fp16lens.{stage}").__all__:
            assert f'id="fp16lens.{stage}.{name}"' in html, (stage, name)
    start = (site / "start/index.html").read_text(encoding="utf-8")
    assert 'href="../watch/"' in start  # the README's docs/watch.md link, on the site
    assert (site / "changelog/index.html").is_file()


def test_the_glossary_defines_the_words_and_benchmarks_name_date_and_machine():
    glossary = (ROOT / "docs/glossary.md").read_text(encoding="utf-8")
    for word in ("Site", "Span", "Headroom", "Region", "FP32 island"):
        assert glossary.count(f"\n**{word}") == 1, word  # defined once
    head = (ROOT / "docs/benchmarks.md").read_text(encoding="utf-8").split("\n## ")[0]
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", head) and "machine" in head and "CPU" in head
