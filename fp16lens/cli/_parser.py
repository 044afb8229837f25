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

    def parse_args(self, args=None, namespace=None):
        """Arguments a command does not take are named with that command's help, and an
        output flag of another command with the option this one writes by."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            hint = _OUTPUT_HINTS.get(command or "", "")
            if not any(e in ("-o", "--output") or e.startswith("--output=") for e in extras):
                hint = ""
            where = f"{self.prog} {command}" if command else self.prog
            self.exit(
                2,
                f"{self.prog}: error: unrecognized arguments: {' '.join(extras)}{hint} "
                f"(see {where} --help)\n",
            )
        return parsed


_OUTPUT_HINTS = {  # -o is export's and patch's output file; what the others write with
    "scan": "; scan writes its report with --save PATH (.json, .html, .svg, .txt, .png)",
    "show": "; show renders the report to a file with --save PATH (.html, .svg, .txt, .png)",
    "verify": "; verify prints its metrics, as JSON with --json",
    "demo": "; demo writes into the folder given by --out",
}


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
