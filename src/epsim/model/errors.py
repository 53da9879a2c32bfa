"""The one exception type users see.

Anything a user can get wrong (an unknown model name, a malformed config.json or profile, a plan whose
sizes do not divide, a batch that does not fit) raises :class:`EpsimError` with a one-line message
that names the offending values. The ``epsim`` front door prints that line and exits with status 2;
any other exception is a bug in epsim.
"""

from __future__ import annotations


class EpsimError(ValueError):
    """A user-facing error: bad input, reported as one line, exit status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
