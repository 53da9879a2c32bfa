"""Subcommands under a command (``epsim calibrate micro|trace|bench``, ``epsim validate
grid|bench``) that keep the command's spellings from before them.

The command's own parser is the legacy form: it carries every mode's flags (hidden from its
help, named in its epilog), added by the same functions that add them to the modes' parsers,
so a flag means the same under both spellings, and its ``run`` picks the mode its flags name.
A mode's parser runs its mode directly. A flag given before the mode's name
(``epsim calibrate --quick micro``) is refused: argparse would let the mode's default
silently replace it.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from .options import add_json_arg

#: a mode: its one-line help, the function adding its flags, the function running it, and
#: optionally its description (default: the help)
Mode = tuple[Any, ...]


@contextlib.contextmanager
def legacy_flags(p: argparse.ArgumentParser, spelled: str) -> Iterator[None]:
    """The flags added within hide from ``p``'s help; its epilog says they still work."""
    before = set(map(id, p._actions))
    yield
    for action in p._actions:
        if id(action) not in before:
            action.help = argparse.SUPPRESS
    p.epilog = (f"Without a subcommand, the flags of its subcommands work here as before "
                f"({spelled}).")


class _Modes(argparse._SubParsersAction):
    """The modes' subparsers: refuse a parent flag given before the mode's name."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: list[str], option_string: str | None = None) -> None:
        given = [a.option_strings[0] for a in parser._actions
                 if a.option_strings and a.dest not in ("help", argparse.SUPPRESS)
                 and getattr(namespace, a.dest, a.default) != a.default]
        if given:
            parser.error(f"{', '.join(given)} before {values[0]!r}: give the flags after the "
                         f"subcommand ({parser.prog} {values[0]} ...)")
        super().__call__(parser, namespace, values, option_string)


def add_modes(p: argparse.ArgumentParser, modes: Mapping[str, Mode]) -> argparse._SubParsersAction:
    """``p``'s subcommands, each with its flags, ``--json`` and its run function."""
    sub = p.add_subparsers(dest="mode", action=_Modes, title="subcommands",
                           description=f"{p.prog} SUBCOMMAND --help: its flags")
    for name, (text, add_args, run, *described) in modes.items():
        about = described[0] if described else text[0].upper() + text[1:] + "."
        mp = sub.add_parser(name, help=text, description=about)
        add_args(mp)
        add_json_arg(mp)
        mp.set_defaults(run=run)
    return sub
