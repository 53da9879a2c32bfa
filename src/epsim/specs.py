"""The argparse types of the validation layer (``epsim/inputs.py``'s table gives every valued
flag one): each parses the text and enforces a stated range, so an absurd or malformed value is
one line and exit status 2 before any work starts; ``describe`` says what it accepts.

Specs:
    Integer(low, high)     an integer within [low, high]. Example: ``--batch``: [1, 2**20]
    Real(low, high, ...)   a finite number within its bounds (``low_open``: ``> low``;
                           ``allow_inf``: ``inf`` too). Example: ``--mem-fraction``: (0, 1]
    Choice(values)         one of fixed words. Example: ``--phase``: decode, prefill
    Items(spec)            a comma list of ``spec`` values, parsed to a tuple: no empty item,
                           no value twice. Example: ``--concurrency 32,64`` -> ``(32, 64)``
    Parsed(parse, what)    text a domain parser reads (an SLO, ``P:D``), its errors one line
    Name(known, what)      a shipped name or an existing file. Example: ``--hardware``
    InputFile(what)        an existing regular file to read
    OutputFile(what)       a path to write: checked here (not a directory, device, FIFO, ...;
                           its folder exists), then reserved and written all-or-nothing by
                           ``epsim.model.outputs.OutputSet`` (see ``epsim.cli``)
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.outputs import check_output_target


class Spec:
    """An argparse type with a stated range; ``describe`` says what it accepts."""

    def __call__(self, text: str) -> Any:  # pragma: no cover - every spec overrides it
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover
        raise NotImplementedError

    def reject(self, text: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"expected {self.describe()}, got {show_text(text)}")


def show_text(text: str, limit: int = 40) -> str:
    """``text`` quoted for a one-line message, its first ``limit`` characters and ``...`` if
    longer (a pasted file must not flood the error). Example: ``show_text("4x")`` -> ``"'4x'"``."""
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _bound(value: float) -> str:
    """A range's end as a reader counts it: ``1048576`` -> ``2**20``, ``10000000`` -> ``10**7``."""
    if isinstance(value, int) and value >= 1024 and (value & (value - 1)) == 0:
        return f"2**{value.bit_length() - 1}"
    if isinstance(value, int) and value >= 10**6 and str(value).rstrip("0") == "1":
        return f"10**{len(str(value)) - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Integer(Spec):
    """An integer in [low, high]. Example: ``Integer(1, 4096)("8") == 8``."""

    low: int
    high: int
    why: str = ""

    def describe(self) -> str:
        why = f" ({self.why})" if self.why else ""
        return f"an integer in [{_bound(self.low)}, {_bound(self.high)}]{why}"

    def __call__(self, text: str) -> int:
        body = str(text).strip()
        if not re.fullmatch(r"[+-]?\d+", body) or len(body) > 30:
            raise self.reject(text)
        value = int(body)
        if not self.low <= value <= self.high:
            raise self.reject(text)
        return value


@dataclass(frozen=True)
class Real(Spec):
    """A finite number in [low, high] (``low_open``: above ``low``; ``allow_inf``: ``inf``
    too). Example: ``Real(0, 1, low_open=True)("0.9") == 0.9``."""

    low: float
    high: float
    low_open: bool = False
    allow_inf: bool = False

    def describe(self) -> str:
        left = "(" if self.low_open else "["
        tail = " or inf" if self.allow_inf else ""
        return f"a number in {left}{_bound(self.low)}, {_bound(self.high)}]{tail}"

    def __call__(self, text: str) -> float:
        body = str(text).strip().lower()
        if self.allow_inf and body in ("inf", "+inf", "infinity"):
            return math.inf
        try:
            value = float(body)
        except ValueError:
            raise self.reject(text) from None
        below = value <= self.low if self.low_open else value < self.low
        if not math.isfinite(value) or below or value > self.high:
            raise self.reject(text)
        return value


@dataclass(frozen=True)
class Choice(Spec):
    """One of ``values``. Example: ``Choice(("fast", "exact"))("exact") == "exact"``."""

    values: tuple[str, ...]

    def describe(self) -> str:
        return f"one of {', '.join(self.values)}"

    def __call__(self, text: str) -> str:
        if text not in self.values:
            raise self.reject(text)
        return text


@dataclass(frozen=True)
class Items(Spec):
    """A comma list of ``item`` values -> a tuple; empty items and repeats are errors.
    Example: ``Items(Integer(1, 8))("2,4") == (2, 4)``."""

    item: Callable[[str], Any]
    max_items: int = 1024

    def describe(self) -> str:
        inner = self.item.describe() if isinstance(self.item, Spec) else "values"
        return f"a comma list of {inner.removeprefix('a ').removeprefix('an ')}"

    def __call__(self, text: str) -> tuple[Any, ...]:
        parts = [p.strip() for p in str(text).split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError("expected a comma list, got an empty value")
        if len(parts) > self.max_items:
            raise argparse.ArgumentTypeError(f"at most {self.max_items} items, got {len(parts)}")
        out: list[Any] = []
        for part in parts:
            if not part:
                raise argparse.ArgumentTypeError(f"an empty item in {show_text(text)}")
            try:
                value = self.item(part)
            except (argparse.ArgumentTypeError, EpsimError) as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
            except ValueError:
                raise argparse.ArgumentTypeError(f"{show_text(part)} is not a valid item") from None
            if value in out:
                raise argparse.ArgumentTypeError(f"{show_text(part)} is given twice")
            out.append(value)
        return tuple(out)


@dataclass(frozen=True)
class Parsed(Spec):
    """Text a domain parser reads (``parse`` raises EpsimError or ValueError on bad input).
    Example: ``Parsed(parse_disagg, "P:D node counts")("1:2") == (1, 2)``."""

    parse: Callable[[str], Any]
    what: str
    max_len: int = 4096

    def describe(self) -> str:
        return self.what

    def __call__(self, text: str) -> Any:
        if len(str(text)) > self.max_len:
            raise argparse.ArgumentTypeError(f"expected {self.what}, got {len(text)} characters")
        try:
            return self.parse(text)
        except EpsimError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        except (ValueError, OverflowError):
            raise self.reject(text) from None


@dataclass(frozen=True)
class Name(Spec):
    """A shipped name (``known()`` lists them) or a path to an existing file.
    Example: ``Name(shipped_models, "model")("deepseek-r1")``."""

    known: Callable[[], Iterable[str]] = field(compare=False)
    what: str

    def describe(self) -> str:
        return f"a shipped {self.what} name ({', '.join(self.known())}) or a file"

    def __call__(self, text: str) -> str:
        if text in set(self.known()):
            return text
        if not text or "\0" in text:
            raise self.reject(text)
        path = Path(text)
        try:
            if path.is_file():
                return text
            exists = path.exists()
        except OSError as exc:  # a name the OS refuses (too long): neither a file nor a name
            raise argparse.ArgumentTypeError(f"unknown {self.what} {show_text(text)}: "
                                             f"{exc.strerror}, nor a shipped name") from None
        if exists:
            raise argparse.ArgumentTypeError(f"{self.what} {text} is not a regular file")
        raise argparse.ArgumentTypeError(
            f"unknown {self.what} {show_text(text)}: no such file, nor a shipped name "
            f"({', '.join(self.known())})")


@dataclass(frozen=True)
class InputFile(Spec):
    """An existing regular file to read. Example: ``--dataset-path sharegpt.json``."""

    what: str

    def describe(self) -> str:
        return f"an existing {self.what}"

    def __call__(self, text: str) -> str:
        if not text or "\0" in text:
            raise self.reject(text)
        path = Path(text)
        try:
            exists, regular = path.exists(), path.is_file()
        except OSError as exc:  # a name the OS refuses (too long)
            raise argparse.ArgumentTypeError(f"{self.what} {show_text(text)}: "
                                             f"{exc.strerror}") from None
        if not exists:
            raise argparse.ArgumentTypeError(f"{self.what} not found: {text}")
        if not regular:
            raise argparse.ArgumentTypeError(f"{self.what} {text} is not a regular file")
        if not os.access(path, os.R_OK):
            raise argparse.ArgumentTypeError(f"{self.what} {text} is not readable")
        return text


class OutputPath(str):
    """A path the command will write (a ``str``): ``epsim.cli`` reserves every one of them
    before the command runs and writes them together when it succeeds."""

    flag: str = ""


@dataclass(frozen=True)
class OutputFile(Spec):
    """A file to write: an existing target must be a regular file, its folder must exist.
    Example: ``--trace step.json``."""

    what: str

    def describe(self) -> str:
        return f"a {self.what} path to write"

    def __call__(self, text: str) -> OutputPath:
        if not text or "\0" in text:
            raise self.reject(text)
        try:
            check_output_target(text, self.what)
        except EpsimError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        out = OutputPath(text)
        out.flag = self.what
        return out


def output_targets(args: argparse.Namespace) -> list[tuple[str, OutputPath]]:
    """Every output path among the parsed arguments, with its flag's description."""
    return [(v.flag or k, v) for k, v in vars(args).items() if isinstance(v, OutputPath)]
