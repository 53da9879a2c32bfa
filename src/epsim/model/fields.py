"""Fields that carry their command line: a dataclass field's flag, aliases and help text.

The data classes of what a user asks for (``epsim.sim.spec``: the deployment and its groups;
``epsim.sim.workload.spec.WorkloadSpec``: the benchmark) declare each field with
:func:`option`, so the command line is generated from them (``epsim/options.py``) and a
deployment file uses the same names: a flag is defined once, where its field is.

    Option       a field's flag, aliases, help text, metavar; ``switch``: a flag without a value
                 that sets the field to this (``--no-eplb`` sets ``eplb`` to False); ``swept``: a
                 comma list where a command sweeps it (``"sweep"``: sweep, tune and plan) or
                 searches it (``"search"``: tune and plan); ``derived``: the flag's
                 default is "not given" (``None``) and the value is derived from others
    option()     a dataclass field with an :class:`Option` in its metadata
    options_of() the ``(field, option)`` pairs of a class
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: the metadata key of a field's command line
OPTION = "epsim.option"


@dataclass(frozen=True)
class Option:
    """A field's command line (the module docstring)."""

    flag: str
    help: str
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    switch: Any = None
    swept: str | None = None
    derived: bool = False


def option(default: Any, flag: str, help: str, **kw: Any) -> Any:
    """A dataclass field whose metadata is its :class:`Option`. Example:
    ``dp: int | None = option(None, "--dp", "data-parallel attention groups")``."""
    return field(default=default, metadata={OPTION: Option(flag, help, **kw)})


def options_of(cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """``(field, option)`` for every field of ``cls`` that has a command line, in field order."""
    for f in dataclasses.fields(cls):
        if OPTION in f.metadata:
            yield f, f.metadata[OPTION]
