"""A deployment as a file: ``--config FILE`` (YAML or JSON), and ``--help=GROUP``.

As vLLM's ``--config``: the file's keys are the command's flags (``max-num-seqs``,
``max_num_seqs`` or ``--max-num-seqs``), each value what the flag would take (a number, a word,
a list where the flag takes a comma list, ``true``/``false`` for a switch). Keys may also be
nested under the groups of a scenario (``epsim.sim.spec``; ``--help=GROUP`` lists each group's
flags), so a file reads as the user thinks of a deployment::

    model: deepseek-r1
    hardware: mi300x
    plan: {dp: 8, ep: 8}
    engine: {engine: vllm, max-num-seqs: 256}
    execution: {dbo: on, kv-dtype: fp8}
    workload: {isl: 2000, osl: 100, concurrency: 4096, num-prompts: 4096}

The flags given on the command line win over the file, the file over the defaults. A key no
flag of the command has, a value its flag refuses or a file that is not a mapping is one line
naming the key, and exit status 2. ``_source`` and keys starting with ``_`` are comments
(where a development check came from).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epsim.model.errors import EpsimError

from .options import GROUPS, add_scenario_args

#: a deployment file is small: this bounds what is read before it is parsed
MAX_CONFIG_BYTES = 1 << 20


def config_path(argv: Sequence[str]) -> str | None:
    """The ``--config`` value in ``argv`` (the last one given), or None."""
    found = None
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            found = argv[i + 1]
        elif token.startswith("--config="):
            found = token.split("=", 1)[1]
    return found


def read_config(path: str) -> dict[str, Any]:
    """The file as one mapping (YAML, or JSON, which YAML reads too)."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise EpsimError(f"--config {path}: larger than {MAX_CONFIG_BYTES} bytes")
        text = p.read_text()
    except OSError as exc:
        raise EpsimError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise EpsimError(f"--config {path}: not a text file") from None
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml's and json's errors alike: one line naming the file
        what = " ".join(str(exc).split())[:200]
        raise EpsimError(f"--config {path}: not valid YAML or JSON ({what})") from None
    if not isinstance(data, Mapping):
        raise EpsimError(f"--config {path}: the file must hold a mapping of flags to values")
    return dict(data)


def _flat(data: Mapping[str, Any], where: str = "") -> dict[str, tuple[str, Any]]:
    """``{key: (where it was written, value)}``: group mappings opened, comments dropped."""
    out: dict[str, tuple[str, Any]] = {}
    for key, value in data.items():
        key = str(key)
        if key.startswith("_"):
            continue
        name = f"{where}{key}"
        if key in GROUPS and isinstance(value, Mapping):  # a group (``engine: vllm`` is a flag)
            found = _flat(value, f"{name}.")
        else:
            found = {key.lstrip("-").replace("-", "_"): (name, value)}
        for flat, (first, _) in found.items():
            if flat in out:
                raise EpsimError(f"{out[flat][0]!r} and {first!r} are the same flag")
        out.update(found)
    return out


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's valued and switch actions by every name a file may use for them."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        for name in (action.dest, *(s.lstrip("-").replace("-", "_")
                                    for s in action.option_strings)):
            found.setdefault(name, action)
    return found


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return ",".join(_text(v) for v in value)
    return str(value)


def _value(action: argparse.Action, key: str, value: Any, *, by_field: bool) -> Any:
    """What the flag would have set had the value been given on the command line
    (``by_field``: the key names the field, so a switch's value is the field's own:
    ``eplb: false``; by the flag's name it says whether the flag is given: ``no-eplb: true``)."""
    if isinstance(action, argparse._StoreConstAction | argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise EpsimError(f"{key} is a switch: true or false, got {value!r}")
        if by_field and not isinstance(action, argparse._StoreTrueAction):
            return value
        on = action.const if not isinstance(action, argparse._StoreTrueAction) else True
        return on if value else action.default
    if action.nargs == "+":
        items = value if isinstance(value, list) else [value]
        return [action.type(_text(v)) if action.type else _text(v) for v in items]
    if action.type is not None:  # the flag's own parser and range (an OnOff's: on/off)
        return action.type(_text(value))
    return _text(value)


@functools.cache
def _deployment_names() -> frozenset[str]:
    """Every name a scenario's flags go by (``epsim.options.add_scenario_args``): what a
    deployment file may hold whichever command reads it."""
    parser = argparse.ArgumentParser(add_help=False)
    add_scenario_args(parser)
    return frozenset(_actions(parser))


def apply_config(parser: argparse.ArgumentParser, path: str) -> None:
    """The file's values as ``parser``'s defaults (so the command line still wins); a flag the
    file gives is no longer required on the command line. A field of a deployment this command
    does not take (a benchmark's for ``step``) is passed over, so one file serves them all."""
    actions = _actions(parser)
    defaults: dict[str, Any] = {}
    known = _deployment_names()
    try:
        given = _flat(read_config(path))
    except EpsimError as exc:
        if str(exc).startswith("--config"):
            raise
        raise EpsimError(f"--config {path}: {exc}") from None
    for key, (where, value) in given.items():
        action = actions.get(key)
        if action is None and key in known:
            continue
        if action is None:
            raise EpsimError(f"--config {path}: unknown key {where!r} (no such flag of "
                             f"{parser.prog})")
        if action.dest in defaults:  # two spellings of one flag (eplb: false, no-eplb: true)
            raise EpsimError(f"--config {path}: {where} gives {action.option_strings[0]} again")
        try:
            defaults[action.dest] = _value(action, where, value, by_field=key == action.dest)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise EpsimError(f"--config {path}: {where}: {' '.join(str(exc).split())}") from None
        except EpsimError as exc:
            raise EpsimError(f"--config {path}: {where}: {exc}") from None
        action.required = False
    parser.set_defaults(**defaults)


def print_group_help(parser: argparse.ArgumentParser, group: str) -> None:
    """``--help=GROUP``: the usage line and that group's flags alone."""
    groups = [g for g in parser._action_groups
              if getattr(g, "epsim_group", None) == group or g.title == group]
    if not groups:
        names = sorted({getattr(g, "epsim_group", None) for g in parser._action_groups} - {None})
        raise EpsimError(f"--help={group}: no such group of {parser.prog} (one of "
                         f"{', '.join(names) or 'none'})")
    formatter = parser._get_formatter()
    formatter.add_text(f"{parser.prog}: the {group} flags ({parser.prog} --help lists all)")
    for g in groups:
        formatter.start_section(g.title)
        formatter.add_arguments(g._group_actions)
        formatter.end_section()
    print(formatter.format_help(), end="")
