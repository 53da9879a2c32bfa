"""Output helpers the commands share (the flags of a deployment are ``epsim/options.py``'s).

    outputs     ``emit_json`` (one JSON object on stdout, its provenance first),
                ``print_columns``, ``print_table``, ``write_csv`` (sweep's and the frontier's
                CSV: one column per JSON key), ``Progress`` (a bar on a terminal)
    flags       the deployment's flag groups and ``scenario_from_args`` are
                ``epsim/options.py``'s (generated from the fields)
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from epsim.model import jsonout
from epsim.model.loads import shipped_loads
from epsim.model.outputs import write_text_atomic

from .provenance import row_provenance, stamp_provenance


def loads_help(what: str) -> str:
    """Help text of a ``--loads``-like flag: a file or one of the shipped names."""
    return (f"{what}: a shipped name ({', '.join(shipped_loads())}) or a file "
            '{"logical_count": [layers][experts]} (.json, or .pt with torch)')


def emit_json(obj: Mapping[str, Any], *profiles: Mapping[str, Any]) -> None:
    """One JSON object on stdout and nothing else there, its provenance first
    (``epsim.stamp.stamp_provenance``: of the results it holds and of ``profiles``); a
    non-finite number is ``null`` (``epsim.model.jsonout``: never NaN or Infinity, which no
    strict parser reads)."""
    out = stamp_provenance(dict(obj), *profiles)
    sys.stdout.write(jsonout.dumps(out, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


class Progress:
    """A one-line progress bar on stderr; silent under --json or when stderr is not a terminal."""

    def __init__(self, label: str, enabled: bool, width: int = 30) -> None:
        self.label, self.width = label, width
        self.enabled = enabled and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        fill = round(self.width * done / total)
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] "
                         f"{done}/{total}")
        sys.stderr.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._shown = False


def _column_cell(v: Any, digits: int) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def print_columns(rows: Sequence[Mapping[str, Any]], cols: Sequence[str], *, digits: int = 1,
                  indent: str = "  ") -> None:
    """One right-aligned column per key of ``cols``, one line per row (sweep's, tune's and
    plan's tables); floats with ``digits`` decimals."""
    cells = [[_column_cell(r.get(c), digits) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(indent + "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print(indent + "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def print_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> None:
    """Two aligned columns."""
    if title:
        print(title)
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    raise AssertionError


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level with dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _csv_cell(value: Any) -> str:
    """A JSON value as a CSV cell, losing nothing: floats as ``repr`` (they read back exactly),
    booleans and lists as JSON spells them, ``None`` empty."""
    if value is None:
        return ""
    if isinstance(value, bool | list | tuple):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_csv(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """The sweep as CSV: one column per key of the points' JSON (nested keys dotted, e.g.
    ``step_breakdown_ms.attention``), in the JSON's order, each row's provenance last
    (``provenance.epsim_version``, ...: a row read alone says what made it); written whole or
    not at all."""
    flat = [flatten({**{k: v for k, v in r.items() if k != "provenance"},
                     "provenance": row_provenance(r)}) for r in rows]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(columns)
    for r in flat:
        w.writerow([_csv_cell(r.get(c)) for c in columns])
    write_text_atomic(buf.getvalue(), path)
