"""The argparse tree: one sub-parser per command, each module owning its own options."""

from __future__ import annotations

import argparse

from fp16lens._core.version import __version__
from fp16lens.cli import _cmd_demo, _cmd_export, _cmd_patch, _cmd_scan, _cmd_show, _cmd_verify

COMMANDS = (_cmd_demo, _cmd_scan, _cmd_show, _cmd_patch, _cmd_export, _cmd_verify)
EPILOG = """exit status: 0 success, 1 a --fail-on policy or a parity check failed,
2 a usage error (bad spec, missing file, missing extra)

start with:  fp16lens demo"""


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line naming the problem and where the options are, exit 2
    (argparse's default prints the whole usage block before it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fp16lens",
        description="Find, explain and fix FP16 overflow in PyTorch models before TensorRT.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fp16lens {__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser
    )
    for command in COMMANDS:
        command.add_parser(sub)
    return parser
