"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml; no plugin to install).

At build time they add three pages that are made, not written:

* ``reference/cli.md``: every command's ``--help``, rendered from the argparse parser of
  ``fp16lens.cli`` (so the reference cannot drift from the command);
* ``start.md``: the repository's README.md, its ``docs/...`` links pointed at the pages;
* ``changelog.md``: CHANGELOG.md.

The pages in docs/ link to ``../README.md`` and ``../CHANGELOG.md`` so that they work on
GitHub; ``on_page_markdown`` points those links at the made pages on the site.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
HELP_WIDTH = "80"  # argparse wraps help at $COLUMNS: one width, so the page is the same everywhere

# link targets outside docs/ (as the pages and the README spell them) -> made pages
_DOCS_LINKS = {"../README.md": "start.md", "../CHANGELOG.md": "changelog.md"}
_README_LINKS = {"CHANGELOG.md": "changelog.md", "docs/README.md": "README.md"}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's commands in the order ``fp16lens --help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """The CLI reference page: ``fp16lens --help`` and each command's ``--help``."""
    from fp16lens.cli._parser import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        parser = build_parser()
        parts = [
            "# CLI reference\n",
            "Generated from the parser of `fp16lens.cli` when the site is built "
            "(`scripts/mkdocs_hooks.py`): each block is what `--help` prints. "
            "The guide to the commands is [the command line](../cli.md).\n",
            "## fp16lens\n",
            _block(parser.format_help()),
        ]
        for name, sub in subcommands(parser).items():
            parts += [f"## fp16lens {name}\n", _block(sub.format_help())]
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return "\n".join(parts)


def _block(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```\n"


def _relink(markdown: str, links: dict[str, str]) -> str:
    """Markdown links ``](old)`` / ``](old#anchor)`` pointed at ``new``."""
    for old, new in links.items():
        markdown = re.sub(r"\]\(" + re.escape(old) + r"(?=[)#])", f"]({new}", markdown)
    return markdown


def readme_page() -> str:
    """README.md as a site page: ``docs/x.md`` links become ``x.md``."""
    text = _relink((ROOT / "README.md").read_text(encoding="utf-8"), _README_LINKS)
    return re.sub(r"\]\(docs/", "](", text)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    from mkdocs.structure.files import File

    made = {
        "reference/cli.md": cli_reference(),
        "start.md": readme_page(),
        "changelog.md": (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"),
    }
    for uri, content in made.items():
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return _relink(markdown, _DOCS_LINKS)
