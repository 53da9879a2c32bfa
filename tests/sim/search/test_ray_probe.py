"""A Ray address is probed before Ray is asked (epsim.sim.search.reach): nothing there is one
line within PROBE_TIMEOUT_S, not minutes of Ray's retries. No test needs Ray but the last."""

import importlib.util
import socket
import threading

import pytest

from epsim.model.errors import EpsimError
from epsim.sim.search import reach


@pytest.mark.parametrize(("address", "expected"), [
    ("10.0.0.5:6379", ("10.0.0.5", 6379)), ("ray://head.local:10001", ("head.local", 10001)),
    ("[::1]:6379", ("::1", 6379))])
def test_addresses_parse(address, expected):
    assert reach.host_port(address) == expected


@pytest.mark.parametrize("address", ["head", "head:", ":6379", "head:0", "head:70000",
                                     "head:63x9"])
def test_a_malformed_address_is_one_line(address):
    with pytest.raises(EpsimError, match="expected auto, local, HOST:PORT"):
        reach.host_port(address)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_something_listens_passes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        reach.probe(f"127.0.0.1:{s.getsockname()[1]}")


def test_a_closed_port_is_refused_in_one_line():
    port = _closed_port()
    with pytest.raises(EpsimError, match=f"--ray 127.0.0.1:{port}: cannot connect"):
        reach.probe(f"127.0.0.1:{port}")


def test_an_address_that_never_answers_is_refused_after_the_timeout(monkeypatch):
    """A host that drops the connection attempt (or a name server that never replies): the
    probe stops waiting after its timeout; the stuck attempt is a daemon thread, left behind."""
    release = threading.Event()

    def hang(*_args, **_kwargs):
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(reach.socket, "create_connection", hang)
    try:
        with pytest.raises(EpsimError, match=r"--ray 192\.0\.2\.1:6379: no answer within 0\.2 s"):
            reach.probe("192.0.2.1:6379", timeout_s=0.2)
    finally:
        release.set()


def test_auto_and_local_are_left_to_ray(monkeypatch):
    monkeypatch.setattr(reach.socket, "create_connection", None)  # never called
    reach.probe("auto")
    reach.probe("local")


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")
def test_the_command_refuses_a_dead_address_in_one_line(epsim):
    port = _closed_port()
    r = epsim("sweep", "--model", "src/epsim/model/configs/tiny-deepseek.json", "--hardware", "mi300x",
              "--isl", "16", "--osl", "4", "--concurrency", "1,2", "--ray", f"127.0.0.1:{port}")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"epsim sweep: error: --ray 127.0.0.1:{port}: cannot connect (Connection refused); "
        "is a Ray cluster running there?"]
