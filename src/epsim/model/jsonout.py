"""JSON that every reader can parse: no NaN, no Infinity.

Python's ``json`` writes ``NaN`` and ``Infinity``, which are not JSON (RFC 8259): ``jq``,
JavaScript's ``JSON.parse`` and Go refuse the whole document. The rule for every JSON epsim
writes (``--json`` on stdout, ``--save-result``, traces, fitted files): a number that is not
finite is written as ``null`` (no value), as JavaScript's ``JSON.stringify`` and pandas'
``to_json`` write it. A value that can be unbounded on purpose (``request_rate`` of an open
loop without a rate) is spelt ``"inf"`` by its producer, as vLLM's result files spell it, and
never reaches this rule. NumPy scalars and arrays are written as Python numbers and lists.

Example: ``dumps({"mean_ttft_ms": float("nan"), "n": np.int64(3)})`` is
``'{"mean_ttft_ms": null, "n": 3}'``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (dicts, lists and tuples
    walked; NumPy scalars and arrays made Python numbers and lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str | int | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    if hasattr(value, "tolist"):  # a NumPy array or scalar (scalar.tolist() is the number)
        return finite(value.tolist())
    if hasattr(value, "item"):  # a torch scalar
        return finite(value.item())
    return value  # json.dumps names what it cannot write


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` under the rule above (``allow_nan=False``: a miss is a bug, raised)."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
