"""``epsim <command> ...``: argument parsing, one-line errors, exit codes.

Commands live in ``epsim.commands``, one module each with ``add_parser(subparsers)`` and
``run(args) -> int``; ``epsim.commands.COMMANDS`` lists them. Every user error is one line on
stderr and exit status 2 (docs/design.md section 3).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from epsim.model.errors import EpsimError

from . import __version__
from .commands import COMMANDS


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"epsim: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="epsim",
        description="Predict, tune and run expert-parallel inference of MoE LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"epsim {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"epsim.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except EpsimError as exc:
        sys.stderr.write(f"epsim {args.command}: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("epsim: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0
