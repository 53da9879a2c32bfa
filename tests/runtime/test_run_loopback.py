"""A local ``epsim run`` stays local: its ranks rendezvous through a file store and their gloo
sockets are on the loopback interface, even where the hostname resolves to a network address or
the user's environment names another interface for multi-node runs (docs/runtime.md)."""

import contextlib
import fcntl
import ipaddress
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

pytest.importorskip("torch")

from epsim.runtime import launch  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(),
                                reason="reading a process's sockets needs Linux's /proc")

_SIOCGIFADDR = 0x8915  # linux/sockios.h


def _ipv4_of(interface: str) -> str | None:
    """The interface's IPv4 address (Linux ioctl), None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def _tcp_addresses(pid: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local address of every TCP socket ``pid`` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            hex_ip = fields[1].split(":")[0]
            # /proc writes each 32-bit word of the address in host (little-endian) order
            raw = b"".join(bytes.fromhex(hex_ip[i:i + 8])[::-1] for i in range(0, len(hex_ip), 8))
            out.append(ipaddress.ip_address(raw))
    return out


def _is_loopback(address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def _rank_pids(parent: int) -> list[int]:
    """The pids whose parent is ``parent`` (its rank processes)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rfind(")") + 1:].split()[1]) == parent:
                    out.append(int(entry.name))
    return out


def test_local_ranks_are_told_the_loopback_interface(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-of-a-cluster")  # set for multi-node runs
    lo = launch.loopback_interface()
    assert lo in launch.LOOPBACK_NAMES and _ipv4_of(lo) == "127.0.0.1"
    env = launch.local_rank_environment()
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == lo


def test_a_local_runs_sockets_are_all_on_loopback(tmp_path):
    # a network interface with an address, named as a multi-node user's environment would: without
    # the loopback pin gloo binds to it
    network = next((name for _, name in socket.if_nameindex()
                    if name not in launch.LOOPBACK_NAMES and _ipv4_of(name)), None)
    env = dict(os.environ, TMPDIR=str(tmp_path), **{launch.FAULT_ENV: "1:1:hang"})
    if network is not None:
        env["GLOO_SOCKET_IFNAME"] = network
    proc = subprocess.Popen(
        [sys.executable, "-m", "epsim", "run", "--model", "tiny-deepseek", "--world-size", "2",
         "--batch", "2", "--context", "4", "--steps", "50"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()  # rank 1 hangs at step 1: both ranks hold their sockets open
        while not list(tmp_path.glob("epsim-run-*/fault.1")):
            assert proc.poll() is None and time.monotonic() - t0 < 60, proc.communicate()
            time.sleep(0.05)
        pids = _rank_pids(proc.pid)
        addresses = {pid: _tcp_addresses(pid) for pid in pids}
        assert len(pids) == 2 and all(addresses.values()), addresses  # gloo's pairs
        assert [a for found in addresses.values() for a in found if not _is_loopback(a)] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 143
