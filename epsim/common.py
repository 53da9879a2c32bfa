"""Argument groups and output helpers the commands share."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.loads import shipped_loads
from epsim.model.plan import KV_DTYPES


def loads_help(what: str) -> str:
    """Help text of a ``--loads``-like flag: a file or one of the shipped names."""
    return (f"{what}: a shipped name ({', '.join(shipped_loads())}) or a file "
            '{"logical_count": [layers][experts]} (.json, or .pt with torch)')


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def request_rate(text: str) -> float:
    """Requests per second: a positive number, or ``inf`` (all at once, as vllm bench serve)."""
    if text.strip().lower() == "inf":
        return math.inf
    return positive_float(text)


def kv_dtype(text: str) -> str:
    if text not in KV_DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(KV_DTYPES)}, got {text!r}")
    return text


def comma_list(text: str | None, convert: Callable[[str], Any], name: str) -> list[Any]:
    """``"1024,2048"`` -> ``[1024, 2048]`` through ``convert``; ``None`` -> ``[None]``. A value
    ``convert`` rejects (ValueError or ArgumentTypeError) is an :class:`EpsimError` naming it."""
    if text is None:
        return [None]
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(convert(part))
        except (ValueError, argparse.ArgumentTypeError):
            raise EpsimError(f"--{name}: {part!r} is not a valid value") from None
    if not out:
        raise EpsimError(f"--{name} is empty")
    return out


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="M",
                        help="shipped model name (e.g. deepseek-r1) or path to a config.json")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallel plan")
    g.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node (default: the hardware profile's, else 8)")
    g.add_argument("--dp", type=positive_int, default=None, help="data-parallel attention groups")
    g.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree")
    g.add_argument("--ep", type=positive_int, default=None,
                   help="expert-parallel degree: 1 or the world size (default: world if dp > 1)")


def emit_json(obj: Mapping[str, Any]) -> None:
    """One JSON object on stdout and nothing else there."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


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


def require(condition: bool, message: str) -> None:
    if not condition:
        raise EpsimError(message)
