"""Local ranks live and die with their launch (docs/runtime.md, "Lifecycle of local ranks"):
SIGTERM or SIGKILL on ``epsim run`` leaves no rank and (SIGTERM) no folder behind; a stopped or
silent rank ends the run within 60 s, named by its number. The watchdog's rules also run against
a fake clock here, without processes."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from conftest import REPO

pytest.importorskip("torch")

from epsim.model.errors import EpsimError  # noqa: E402
from epsim.runtime import launch, lifecycle  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="finding rank processes reads /proc")

RUN = ["run", "--model", "tiny-deepseek", "--world-size", "2", "--batch", "2", "--context", "4"]


# --------------------------------------------------------------------------------------------
# processes, through /proc
# --------------------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...), None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 1:].split()


def _alive(pid: int) -> bool:
    """Running, sleeping or stopped; a zombie (killed, not yet reaped by whoever adopted it) is
    gone."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _workers(parent: int, module: str) -> dict[int, tuple[int, str]]:
    """pid -> (rank, folder) of ``parent``'s children running ``python -m module FOLDER RANK``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is None or int(fields[1]) != parent or fields[0] == "Z":
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:
            continue
        if module in argv:
            found[int(entry.name)] = (int(argv[-1]), argv[-2])
    return found


def _wait_for_ranks(proc: subprocess.Popen, world: int = 2, module: str = "epsim.runtime.worker",
                    marker: str | None = None,
                    timeout: float = 60) -> tuple[dict[int, int], Path]:
    """rank -> pid of ``proc``'s ranks and their folder, once every rank beats (and ``marker``,
    a file the fault hook touches mid-run, exists in the folder)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        found = _workers(proc.pid, module)
        if len(found) == world:
            folder = Path(next(iter(found.values()))[1])
            names = [f"heartbeat.{r}" for r in range(world)] + ([marker] if marker else [])
            if all(Path(folder, name).exists() for name in names):
                return {rank: pid for pid, (rank, _) in found.items()}, folder
        time.sleep(0.05)
    raise AssertionError(f"{world} ranks did not start within {timeout} s")


def _wait_gone(pids, within: float) -> list[int]:
    """The pids still alive after ``within`` seconds (waiting no longer than needed)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if not any(_alive(p) for p in pids):
            return []
        time.sleep(0.02)
    return [p for p in pids if _alive(p)]


def _cleanup(proc: subprocess.Popen, pids) -> None:
    """Whatever a failing test left: continue stopped ranks, kill them and the parent."""
    for pid in list(pids) + [proc.pid]:
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.communicate(timeout=10)


def _epsim(tmp_path: Path, *args: str, fault: str | None = None) -> subprocess.Popen:
    """``python -m epsim ARGS`` with its temporary folders (the run's folder) in ``tmp_path``."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop(launch.FAULT_ENV, None)
    if fault:
        env[launch.FAULT_ENV] = fault
    return subprocess.Popen([sys.executable, "-m", "epsim", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)




# --------------------------------------------------------------------------------------------
# the parent ends
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_on_the_parent_stops_every_rank_and_removes_the_folder(tmp_path, sig, status):
    # rank 1 hangs at step 2 (rank 0 waits for it in a collective): mid-run until signalled
    proc = _epsim(tmp_path, *RUN, "--steps", "50", fault="1:2:hang")
    pids: dict[int, int] = {}
    try:
        pids, folder = _wait_for_ranks(proc, marker="fault.1")
        assert folder.parent == tmp_path and folder.name.startswith(f"epsim-run-{proc.pid}-")
        time.sleep(0.5)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=5)
        assert proc.returncode == status
        name = signal.Signals(sig).name
        assert stderr.splitlines() == [f"epsim run: error: terminated by {name}; 2 ranks stopped"]
        assert _wait_gone(pids.values(), within=5) == []
        assert not folder.exists() and list(tmp_path.glob("epsim-run-*")) == []
    finally:
        _cleanup(proc, pids.values())


def test_sigkill_on_the_parent_takes_the_ranks_with_it(tmp_path):
    proc = _epsim(tmp_path, *RUN, "--steps", "50", fault="1:2:hang")
    pids: dict[int, int] = {}
    try:
        pids, folder = _wait_for_ranks(proc, marker="fault.1")
        time.sleep(0.5)
        proc.kill()
        proc.wait(timeout=5)
        assert _wait_gone(pids.values(), within=5) == []  # the parent-death signal
        # nothing could remove the folder; a later launch does, once it has been quiet
        assert folder.is_dir()
        assert lifecycle.remove_stale_folders("epsim-run-", str(tmp_path)) == []  # not quiet
        assert lifecycle.remove_stale_folders("epsim-run-", str(tmp_path), quiet_s=0) == [
            str(folder)]
        assert not folder.exists()
    finally:
        _cleanup(proc, pids.values())


def test_sigterm_on_a_calibration_parent_stops_its_ranks(tmp_path):
    code = ("from epsim.calibrate.comm_bench import run_ranks\n"
            "from epsim.model.errors import EpsimError\n"
            "try:\n"
            "    run_ranks(2, (8,), 100000, 2, 1, 64, 1)\n"
            "except EpsimError as exc:\n"
            "    raise SystemExit(f'{exc} / {exc.exit_status}')\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: dict[int, int] = {}
    try:
        # the file store exists once the ranks join their process group
        pids, folder = _wait_for_ranks(proc, module="epsim.calibrate.comm_bench", marker="store")
        time.sleep(0.5)
        proc.terminate()
        _, stderr = proc.communicate(timeout=5)
        assert stderr.strip() == "terminated by SIGTERM; 2 ranks stopped / 143"
        assert _wait_gone(pids.values(), within=5) == []
        assert not folder.exists()
    finally:
        _cleanup(proc, pids.values())


# --------------------------------------------------------------------------------------------
# a rank stops responding
# --------------------------------------------------------------------------------------------


def test_a_stopped_rank_ends_the_run_naming_it(tmp_path):
    # far longer than the test; rank 1 marks its step 3, then is stopped mid-run
    proc = _epsim(tmp_path, *RUN, "--steps", "4000", fault="1:3:mark")
    pids: dict[int, int] = {}
    try:
        pids, folder = _wait_for_ranks(proc, marker="fault.1")
        os.kill(pids[1], signal.SIGSTOP)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2
        lines = stderr.splitlines()
        assert len(lines) == 1 and "rank 1 stopped responding" in lines[0], stderr
        assert "stopped" in lines[0].split("rank 1 stopped responding", 1)[1]
        assert _wait_gone(pids.values(), within=5) == []
        assert not folder.exists()
    finally:
        _cleanup(proc, pids.values())


def test_a_rank_without_heartbeat_ends_the_run_naming_it(tmp_path):
    # rank 1 silences its heartbeat and sleeps (not stopped: only the heartbeat shows it)
    proc = _epsim(tmp_path, *RUN, "--steps", "50", fault="1:2:mute")
    pids: dict[int, int] = {}
    try:
        pids, _ = _wait_for_ranks(proc, marker="fault.1")
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2
        limit = f"{lifecycle.HEARTBEAT_STALE_S:g}"
        assert stderr.splitlines() == [
            f"epsim run: error: rank 1 stopped responding (no heartbeat for {limit} s; "
            "stopped or hung)"]
        assert _wait_gone(pids.values(), within=5) == []
    finally:
        _cleanup(proc, pids.values())


def test_a_hung_rank_whose_heartbeat_beats_is_named_within_the_stall_timeout(tmp_path):
    # rank 1 sleeps at step 2 with its heartbeat beating; rank 0 then waits for it in a
    # collective (the collective timeout, 120 s, is far off)
    proc = _epsim(tmp_path, *RUN, "--steps", "50", "--stall-timeout", "5", fault="1:2:hang")
    pids: dict[int, int] = {}
    try:
        pids, _ = _wait_for_ranks(proc, marker="fault.1")
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2
        assert stderr.splitlines() == [
            "epsim run: error: rank 1 stopped making progress (no rank finished any work for "
            "5 s; rank 1 is not waiting in a collective; its heartbeat still beats: hung)"]
        assert _wait_gone(pids.values(), within=5) == []
    finally:
        _cleanup(proc, pids.values())


# --------------------------------------------------------------------------------------------
# the rules, without processes
# --------------------------------------------------------------------------------------------


def _progress(folder: Path, rank: int, count: int, last: float, waits: int = 0) -> None:
    """What a rank's heartbeat thread writes: its count of finished work, when the last was, and
    the collectives it is blocked in."""
    path = folder / f"progress.{rank}"
    path.write_text(f"{count} {last!r} {waits}")
    os.utime(path, ns=(count * 10**9, count * 10**9 + rank))


def test_the_watchdog_names_the_rank_that_progressed_last_longest_ago(tmp_path):
    clock, procs = _Clock(), [_FakeProc(10), _FakeProc(11), _FakeProc(12)]
    dog = lifecycle.Watchdog(str(tmp_path), procs, clock=clock, state=lambda pid: "S",
                             stall_s=10)
    assert dog.check() is None  # nobody reported progress yet: not counted
    for second in range(1, 30):
        clock.now += 1
        for rank in range(3):
            _beat(tmp_path, rank, second)  # every heartbeat beats throughout
        # rank 1 stops at 5 s; ranks 0 and 2 work on until they wait for it in a collective
        # (from 8 s, 9 s); rank 0 had waited once before, at 3 s
        for rank, stops in ((0, 8), (1, 5), (2, 9)):
            if second <= stops:
                _progress(tmp_path, rank, second, 500.0 + second, int(second in (3, stops)
                                                                      and rank != 1))
        # rank 2 progressed last at 9 s: the run is hung 10 s later
        expected = None if second < 19 else (
            "rank 1 stopped making progress (no rank finished any work for 10 s; rank 1 is not "
            "waiting in a collective; its heartbeat still beats: hung)")
        assert dog.check() == expected, second
    # were rank 1 waiting too (a collective nobody completes), the longest without progress
    _progress(tmp_path, 1, 5, 505.0, 1)
    os.utime(tmp_path / "progress.1", ns=(99 * 10**9,) * 2)
    for second in range(30, 40):  # entering the wait was news: 10 s more
        clock.now += 1
        for rank in range(3):
            _beat(tmp_path, rank, second)
        assert dog.check() is None, second
    clock.now += 1
    assert dog.check() == (
        "rank 1 stopped making progress (no rank finished any work for 10 s; every rank waits "
        "in a collective, rank 1 the longest; its heartbeat still beats: hung)")


def test_a_rank_working_alone_keeps_its_waiting_peers_from_being_named(tmp_path):
    clock, procs = _Clock(), [_FakeProc(10), _FakeProc(11)]
    dog = lifecycle.Watchdog(str(tmp_path), procs, clock=clock, state=lambda pid: "S",
                             stall_s=10)
    for second in range(1, 40):
        clock.now += 1
        _beat(tmp_path, 0, second)
        _beat(tmp_path, 1, second)
        # rank 0 checks the run alone for 30 s while rank 1 waits at the barrier
        _progress(tmp_path, 0, second, 500.0 + second)
        if second == 1:
            _progress(tmp_path, 1, 1, 501.0)
        assert dog.check() is None, second
    # without a stall timeout a run whose ranks beat but never progress is never named
    quiet = lifecycle.Watchdog(str(tmp_path), procs, clock=clock, state=lambda pid: "S",
                               stall_s=None)
    for second in range(100, 160):
        clock.now += 1
        _beat(tmp_path, 0, second)
        _beat(tmp_path, 1, second)
        assert quiet.check() is None, second


class _FakeProc:
    def __init__(self, pid: int, returncode: int | None = None) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int | None:
        return self.returncode


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _beat(folder: Path, rank: int, ns: int) -> None:
    path = folder / f"heartbeat.{rank}"
    path.touch()
    os.utime(path, ns=(ns, ns))


def test_the_watchdog_names_the_silent_rank_not_its_beating_peer(tmp_path):
    clock, procs = _Clock(), [_FakeProc(10), _FakeProc(11)]
    dog = lifecycle.Watchdog(str(tmp_path), procs, clock=clock, state=lambda pid: "S")
    for second in range(int(lifecycle.HEARTBEAT_STALE_S) + 1):
        clock.now += 1
        _beat(tmp_path, 0, second)  # rank 0 beats on, rank 1 never beats
        expected = None if second + 1 < lifecycle.HEARTBEAT_STALE_S else (
            "rank 1 stopped responding (no heartbeat for "
            f"{lifecycle.HEARTBEAT_STALE_S:g} s; stopped or hung)")
        assert dog.check() == expected, second
    assert set(dog.suspects()) == {1}


def test_the_watchdog_names_a_stopped_rank_after_its_limit(tmp_path):
    clock, procs = _Clock(), [_FakeProc(10), _FakeProc(11)]
    states = {10: "S", 11: "S"}
    dog = lifecycle.Watchdog(str(tmp_path), procs, clock=clock, state=states.get)
    assert dog.check() is None
    states[11] = "T"
    clock.now += 1
    assert dog.check() is None  # stopped since now
    clock.now += lifecycle.STOPPED_LIMIT_S
    assert dog.check() == ("rank 1 stopped responding (its process is stopped, e.g. by SIGSTOP, "
                           f"for {lifecycle.STOPPED_LIMIT_S:g} s)")
    states[11] = "S"  # continued: no longer counted
    clock.now += 1
    assert dog.check() is None


def test_a_suspect_is_the_root_cause_when_its_peers_only_timed_out(tmp_path):
    (tmp_path / "error.0").write_text(json.dumps(
        {"rank": 0, "time": 1.0, "user_error": False,
         "message": "RuntimeError: Timed out waiting 10000ms for send operation to complete"}))
    procs = [_FakeProc(10, 1), _FakeProc(11, -9)]
    message = launch._root_cause(procs, str(tmp_path), {0: 1.0},
                                 {1: "its process is stopped, e.g. by SIGSTOP"})
    assert message == ("rank 1 stopped responding (its process is stopped, e.g. by SIGSTOP); "
                       "1 other rank(s) failed waiting for it")
    # a primary report stays the cause
    (tmp_path / "error.0").write_text(json.dumps(
        {"rank": 0, "time": 1.0, "user_error": False, "message": "ValueError: bad"}))
    assert launch._root_cause(procs, str(tmp_path), {0: 1.0}, {1: "x"}).startswith(
        "rank 0 failed: ValueError: bad")


def test_stale_folders_of_live_parents_or_other_prefixes_stay(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # a pid that existed and is gone
    stale = tmp_path / f"epsim-run-{dead.pid}-abc"
    live = tmp_path / f"epsim-run-{os.getppid()}-abc"
    other = tmp_path / f"epsim-calib-{dead.pid}-abc"
    old_style = tmp_path / "epsim-run-abcdefgh"
    for folder in (stale, live, other, old_style):
        folder.mkdir()
    assert lifecycle.remove_stale_folders("epsim-run-", str(tmp_path), quiet_s=0) == [str(stale)]
    assert live.exists() and other.exists() and old_style.exists()


def test_run_terminated_is_an_epsim_error_with_the_signal_exit_status():
    exc = launch.RunTerminated(signal.SIGTERM, 1)
    assert isinstance(exc, EpsimError)
    assert (str(exc), exc.exit_status) == ("terminated by SIGTERM; 1 rank stopped", 143)
    assert launch.RunTerminated.exit_status == 143
    assert launch.RunTerminated(signal.SIGHUP, 2).exit_status == 129


def test_the_command_line_exits_with_the_errors_exit_status(capsys):
    """A run ended by a signal exits 128 + the signal through ``epsim.cli.main``, in one line."""
    from epsim import cli
    from epsim.commands import describe

    def terminated(args):
        raise launch.RunTerminated(signal.SIGTERM, 2)

    with mock.patch.object(describe, "run", terminated):
        assert cli.main(["describe", "--model", "tiny-deepseek"]) == 143
    assert capsys.readouterr().err.count("\n") == 1


def test_termination_signals_are_restored_after_the_launch():
    before = signal.getsignal(signal.SIGTERM)
    with lifecycle.TerminationSignals() as signals:
        assert signal.getsignal(signal.SIGTERM) != before
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
        time.sleep(0.05)
        assert signals.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
