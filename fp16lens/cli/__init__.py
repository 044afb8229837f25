"""Command-line interface (placeholder until the CLI lands)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp16lens")
    parser.parse_args(argv)
    return 0
