"""Signals during a search with two worker processes (tune, plan, sweep): the command ends with
one line and 128 + the signal, no answer, no output file or temp file, and no process of its
pool left; killed outright (SIGKILL), its pool workers, forkserver and resource tracker go too
(epsim.sim.search.lifeline)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

# 50,000 requests a point: minutes of work however fast the machine (a sweep of one
# concurrency's requests a point once finished within the test's second of warm-up)
SEARCH = ["--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "1000", "--osl", "100",
          "--num-prompts", "50000", "--workers", "2"]
SLO = ["--slo", "median_itl_ms<=100"]
#: long enough that it is still searching when the signal comes (it never finishes)
COMMANDS = {
    "tune": ["tune", *SEARCH, *SLO],
    "plan": ["plan", *SEARCH, *SLO, "--target-output-throughput", "100000"],
    "sweep": ["sweep", *SEARCH, "--concurrency", "64,128,256,512,1024,2048,4096",
              "--kv-dtype", "fp8,bf16"],
}
WAIT_S = 240  # a bound on a loaded machine, not a timing claim


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z":
            out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def descendants(pid: int) -> set[int]:
    kids, found, todo = _children(), set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2] != "Z":
            out.add(pid)
    return out


def wait_gone(pids: set[int]) -> set[int]:
    deadline = time.monotonic() + 30
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def start_search(argv: list[str], tmp_path: Path, *, group: bool = False
                 ) -> tuple[subprocess.Popen, set[int], Path]:
    """The command, started with an output file and its own $TMPDIR, once its pool runs: the
    process, its pool's processes (forkserver, resource tracker, two workers)."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    out = tmp_path / "out" / "frontier.csv"
    out.parent.mkdir()
    flag = "--csv" if argv[0] == "sweep" else "--frontier-csv"
    p = subprocess.Popen([sys.executable, "-m", "epsim", *argv, flag, str(out)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TMPDIR": str(tmpdir)}, start_new_session=group)
    deadline = time.monotonic() + WAIT_S
    pool: set[int] = set()
    while len(pool) < 4 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        pool = descendants(p.pid)
    if len(pool) < 4:
        p.kill()
        pytest.fail(f"the pool never started: {p.communicate()[1][-2000:]}")
    time.sleep(1.0)  # the workers are on their points
    return p, pool, out


@pytest.mark.parametrize(("command", "sig"), [
    ("tune", signal.SIGTERM), ("plan", signal.SIGHUP), ("sweep", signal.SIGINT)])
def test_a_signal_ends_a_search_in_one_line_with_nothing_left(tmp_path, command, sig):
    p, pool, out = start_search(COMMANDS[command], tmp_path)
    try:
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=WAIT_S)
    finally:
        p.kill()
    assert p.returncode == 128 + sig, stderr  # 143, 129, 130: the shell's convention
    assert stderr.splitlines() == [f"epsim {command}: error: terminated by {sig.name}"]
    assert stdout == ""  # no answer from an interrupted search
    assert wait_gone(pool) == set()
    assert list(out.parent.iterdir()) == []  # neither the output nor a temp file
    assert list((tmp_path / "tmpdir").iterdir()) == []  # the pool's pymp-* folder went too


def test_a_signal_to_the_whole_process_group_is_one_line_not_one_per_worker(tmp_path):
    """Ctrl-C reaches every process of the terminal's group: the workers leave it to the
    command (one line), not one KeyboardInterrupt traceback each."""
    p, pool, out = start_search(COMMANDS["sweep"], tmp_path, group=True)
    try:
        os.killpg(p.pid, signal.SIGINT)  # its own session: the group is the command's
        _, stderr = p.communicate(timeout=WAIT_S)
    finally:
        p.kill()
    assert p.returncode == 130
    assert stderr.splitlines() == ["epsim sweep: error: terminated by SIGINT"]
    assert wait_gone(pool) == set()
    assert list(out.parent.iterdir()) == []


def test_the_pool_goes_when_its_command_is_killed(tmp_path):
    """SIGKILL runs no clean-up in the command: its workers see it gone and exit, and then the
    forkserver and the resource tracker, whose pipes close (they used to wait for ever)."""
    p, pool, out = start_search(COMMANDS["tune"], tmp_path)
    p.kill()
    p.communicate(timeout=WAIT_S)
    assert p.returncode == -signal.SIGKILL
    assert wait_gone(pool) == set()
    assert list(out.parent.iterdir()) == []  # outputs are held in memory until the end
    assert list((tmp_path / "tmpdir").iterdir()) == []  # its pymp-* folder: a worker removed it


@pytest.mark.parametrize(("argv", "match"), [
    (["sweep", *SEARCH[:4], "--isl", "100,200000", "--osl", "10", "--workers", "2"],
     "200000"),
    (["tune", *SEARCH, *SLO, "--splits", "8x1,4x3"], "--splits 4x3"),
    (["plan", *SEARCH, *SLO, "--target-output-throughput", "1e300"], "target"),
])
def test_a_refusal_comes_before_the_pool_and_leaves_tmpdir_empty(tmp_path, argv, match):
    """Every value is checked before a worker process (or its pymp-* folder) is made."""
    r = subprocess.run([sys.executable, "-m", "epsim", *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=WAIT_S, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and match in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has its own handler for ``sig`` (/proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_serial_search_is_not_finished_without_the_point_a_signal_stopped(tmp_path):
    """--workers 1: the signal arrives inside a point's simulation, where a search skips the
    points that cannot run (an EpsimError); it is not one of them. The search used to count it
    as a skipped point, go on for minutes and exit 0 with an answer."""
    p = subprocess.Popen([sys.executable, "-m", "epsim", "tune", *SEARCH[:-1], "1", *SLO,
                          "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not _catches(p.pid, signal.SIGTERM) and time.monotonic() < deadline:
            time.sleep(0.05)  # until epsim's handler is in place (before: Python's default)
        time.sleep(3)  # into the search, which runs for minutes
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=WAIT_S)
    finally:
        p.kill()
    assert p.returncode == 143, stderr
    assert stderr.splitlines() == ["epsim tune: error: terminated by SIGTERM"]
    assert stdout == ""
