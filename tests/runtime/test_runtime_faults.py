"""Faults: a failing or killed rank ends the run non-zero with its message, quickly; ranks with
different configurations stop at start-up."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO

pytest.importorskip("torch")

RUN = ["run", "--model", "tiny-deepseek", "--world-size", "2", "--batch", "2", "--context", "4",
       "--steps", "3"]


def test_a_rank_that_raises_ends_the_run_with_its_message(epsim, monkeypatch):
    monkeypatch.setenv("EPSIM_RUNTIME_FAULT", "1:1")
    t0 = time.monotonic()
    out = epsim(*RUN, "--dbo", timeout=60)
    assert time.monotonic() - t0 < 60
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "rank 1 failed: RuntimeError: injected fault on rank 1 at step 1" in lines[0]
    assert out.stdout == ""


def test_a_killed_rank_ends_the_run(epsim, monkeypatch):
    monkeypatch.setenv("EPSIM_RUNTIME_FAULT", "0:1:kill")
    t0 = time.monotonic()
    out = epsim(*RUN, "--json", timeout=60)
    assert time.monotonic() - t0 < 60
    assert out.returncode == 2
    assert "rank 0 failed: was killed by signal 9" in out.stderr
    assert out.stdout == ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_like(rank: int, world: int, port: int, *args: str) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("EPSIM_RUNTIME_FAULT", None)
    return subprocess.Popen([sys.executable, "-m", "epsim", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _common(batch: str) -> list[str]:
    return ["run", "--model", "tiny-deepseek", "--batch", batch, "--context", "4", "--steps", "2",
            "--timeout", "30"]


def test_ranks_that_disagree_on_the_configuration_stop_at_start_up():
    port = _free_port()
    procs = [_torchrun_like(0, 2, port, *_common("2"), "--json"),
             _torchrun_like(1, 2, port, *_common("3"), "--json")]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 2, stderr
        assert "ranks disagree on the configuration" in stderr
        assert stdout == ""


def test_the_same_entry_runs_under_torchrun_env():
    port = _free_port()
    procs = [_torchrun_like(r, 2, port, *_common("2"), "--check", "--json") for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    summary = json.loads(outs[0][0])  # rank 0 reports, the other rank prints nothing
    assert outs[1][0] == ""
    assert summary["world_size"] == 2
    assert summary["max_rel_err"] < 1e-4
