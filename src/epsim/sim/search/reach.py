"""Whether a Ray cluster address answers, asked before Ray is.

``ray.init(address=...)`` with nothing at the address retries its connection for minutes,
printing Ray's own log lines; a user who mistyped a host waits and reads noise. So an address
(``HOST:PORT``, ``ray://HOST:PORT``, ``[IPv6]:PORT``) is first given one TCP connection attempt,
name resolution included, and refused in one line when none is made within
:data:`PROBE_TIMEOUT_S`. ``auto`` (Ray finds the local cluster itself and says at once when
there is none) and ``local`` (started here) are not probed. A port that accepts a connection
is not proof that Ray is behind it: what answers there is then Ray's to judge.
"""

from __future__ import annotations

import socket
import threading

from epsim.model.errors import EpsimError

#: seconds an address has to accept a TCP connection (a cluster on the same network answers in
#: milliseconds; this leaves room for a slow name server)
PROBE_TIMEOUT_S = 5.0

#: addresses Ray resolves itself, not probed
NOT_PROBED = ("auto", "local")


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of a Ray address; one line naming the address when it is not one."""
    rest = address.removeprefix("ray://")
    host, colon, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:6379
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EpsimError(f"--ray {address}: expected auto, local, HOST:PORT or "
                         "ray://HOST:PORT")
    return host, int(port)


def _connect(host: str, port: int, timeout_s: float, outcome: list[BaseException | None]
             ) -> None:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        outcome.append(None)
    except OSError as exc:
        outcome.append(exc)


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Return when ``address`` accepts a TCP connection within ``timeout_s``; else one line.
    The attempt runs in a daemon thread because name resolution has no timeout of its own."""
    if address in NOT_PROBED:
        return
    host, port = host_port(address)
    outcome: list[BaseException | None] = []
    attempt = threading.Thread(target=_connect, args=(host, port, timeout_s, outcome),
                               daemon=True, name="epsim-ray-probe")
    attempt.start()
    attempt.join(timeout_s)
    if not outcome:
        raise EpsimError(f"--ray {address}: no answer within {timeout_s:g} s; is a Ray "
                         "cluster running there?")
    if outcome[0] is not None:
        why = outcome[0].strerror or type(outcome[0]).__name__
        raise EpsimError(f"--ray {address}: cannot connect ({why}); is a Ray cluster "
                         "running there?")
