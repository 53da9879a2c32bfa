"""The one exception type users see.

Anything a user can get wrong (an unknown model name, a malformed config.json or profile, a plan whose
sizes do not divide, a batch that does not fit) raises :class:`EpsimError` with a one-line message
that names the offending values. The ``epsim`` front door prints that line and exits with status 2;
any other exception is a bug in epsim.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class EpsimError(ValueError):
    """A user-facing error: bad input, reported as one line, exit status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def read_json_file(path: str | os.PathLike[str], what: str, kind: str = "") -> Any:
    """Parse the JSON file at ``path``; a missing or malformed file is an :class:`EpsimError`
    naming ``what`` it should have been (e.g. ``"load file"``), or the ``kind`` of JSON expected
    (e.g. ``"grid"``) and the parse error's line."""
    file = Path(path)
    if not file.is_file():
        raise EpsimError(f"{what} not found: {file}")
    try:
        return json.loads(file.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as exc:
        label = f"{kind} JSON" if kind else "JSON"
        raise EpsimError(f"{file}: malformed {label} ({exc.msg} at line {exc.lineno})") from None
