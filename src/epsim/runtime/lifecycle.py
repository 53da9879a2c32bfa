"""The life of locally spawned rank processes, shared by ``epsim run`` and the calibration
benchmarks (docs/runtime.md, "Lifecycle of local ranks").

The launching parent and its ranks are tied together both ways:

* **The ranks die with the parent.** They run in their own process group (one signal stops them
  all; a terminal's Ctrl-C reaches only the parent, which then stops them). Each rank asks Linux
  for a parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) as its first act, so even a
  SIGKILLed parent takes its ranks with it; its heartbeat thread also exits the rank once its
  parent is gone (the fallback where prctl does not exist). SIGTERM or SIGHUP on the parent
  (:class:`TerminationSignals`) stops every rank, removes the run's folder and ends the launch.
* **The parent notices a rank that stopped responding.** Each rank touches
  ``FOLDER/heartbeat.<rank>`` every :data:`HEARTBEAT_INTERVAL_S`; :class:`Watchdog` names the rank
  whose heartbeat is older than :data:`HEARTBEAT_STALE_S`, or that Linux shows stopped (state
  ``T``, e.g. SIGSTOP) for :data:`STOPPED_LIMIT_S`. The heartbeat is a thread, so it shows that
  the process is alive, not that it progresses.
* **The parent notices a rank that stopped making progress.** A rank counts its finished work
  (:func:`progress`: every op, step and start-up phase) and its heartbeat thread writes the count
  and the time of the last one to ``FOLDER/progress.<rank>`` when it changed, with whether the
  rank is waiting on its peers in a collective (:func:`waiting_on_peers`). When no rank has
  finished anything for the stall timeout (:data:`STALL_S` by default), the run is hung: a rank
  that hangs stops its peers too, in their next collective, so the rank named is one that is not
  waiting on its peers (the longest without progress among them; among all ranks when every one
  waits), whether or not its heartbeat still beats. Counting the run as a whole, not each rank,
  keeps ranks that wait for a busy peer from being named.

A run's folder is ``<tmp>/<prefix><parent pid>-XXXXXXXX``; a parent killed with SIGKILL cannot
remove it, so every later launch removes the folders of parents that no longer exist
(:func:`remove_stale_folders`).

This module imports only the standard library: a worker loads it before anything heavy.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: how often a rank touches its heartbeat file
HEARTBEAT_INTERVAL_S = 1.0
#: a rank whose heartbeat is this old stopped responding: far above the interval so a loaded
#: 2-core machine (or a slow start-up before the first beat) never trips it, far below the
#: 60 s within which a stalled run must end
HEARTBEAT_STALE_S = 20.0
#: a rank Linux shows stopped (state T) this long ends the run, before its heartbeat goes stale
STOPPED_LIMIT_S = 5.0
#: no rank finished any work (an op, a step) for this long: the run is hung and the rank that
#: progressed last longest ago is named. Far above any op or step of a run this runtime makes
#: (milliseconds on a CPU) and a loaded machine's hiccups; with the heartbeat's interval and the
#: checks' it names a hung rank within 60 s (``epsim run --stall-timeout``)
STALL_S = 40.0
#: a heartbeat this old makes a rank a suspect when its peers fail waiting for it
SUSPECT_AGE_S = 3 * HEARTBEAT_INTERVAL_S
#: the parent polls its ranks this often, and reads heartbeats and process states this often
POLL_S = 0.02
CHECK_INTERVAL_S = 0.25
#: the parent's pid, passed to each rank so it can tell that its parent died before it started
PARENT_PID_ENV = "EPSIM_PARENT_PID"

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


# --------------------------------------------------------------------------------------------
# The run's folder
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def run_folder(prefix: str) -> Iterator[str]:
    """A new folder ``<tmp>/<prefix><pid>-XXXXXXXX`` for one launch, removed afterwards; stale
    folders of dead parents with the same prefix are removed first."""
    remove_stale_folders(prefix)
    folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_stale_folders(prefix: str, root: str | None = None,
                         quiet_s: float = HEARTBEAT_STALE_S) -> list[str]:
    """Remove this user's ``<prefix><pid>-*`` folders under ``root`` (default: the temporary
    folder) whose launching process no longer exists and in which nothing changed for
    ``quiet_s`` (the second test guards against a live launch in another pid namespace sharing
    the folder). Returns the removed paths."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)-[^/]+$")
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{prefix}*-*"):
        match = pattern.match(path.name)
        if not match or int(match.group(1)) == os.getpid() or _pid_alive(int(match.group(1))):
            continue
        try:
            st = path.stat()
            if not path.is_dir() or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
                continue
            newest = max([st.st_mtime] + [p.stat().st_mtime for p in path.iterdir()])
        except OSError:  # removed meanwhile, or unreadable: not ours to clean
            continue
        if time.time() - newest >= quiet_s:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


class TerminationSignals:
    """While entered, SIGTERM and SIGHUP are recorded in :attr:`signum` instead of ending the
    parent, so the launch can stop its ranks and clean up first; the previous handlers come back
    on exit. The handler only records: raising from it could interrupt a Popen half-way and lose
    a rank. Off the main thread (where Python cannot install handlers) this does nothing."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                    if hasattr(signal, name))

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> TerminationSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            # None: a handler installed outside Python; the default is the closest we can restore
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()


class RankProcesses:
    """The rank processes of one launch: spawned into one new process group, each told its
    parent's pid; :meth:`stop` kills whatever still runs and waits for it. A context manager that
    stops on exit, so no path out of a launch leaves a rank behind."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.groups: list[int | None] = []  # each process's group, None without process groups
        self.exit_seen: dict[int, float] = {}  # rank -> wall time its exit was first seen
        self._logs: list[Any] = []

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str,
              log_path: Path | None = None) -> subprocess.Popen:
        """Start the next rank (``argv``); its stdout and stderr go to ``log_path`` (or nowhere)."""
        log: Any = subprocess.DEVNULL
        if log_path is not None:
            log = open(log_path, "w")  # noqa: SIM115 - closed by stop()
            self._logs.append(log)
        env = dict(env, **{PARENT_PID_ENV: str(os.getpid())})
        kwargs: dict[str, Any] = dict(stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                      cwd=cwd)
        leader = next((g for g in self.groups if g is not None), None)
        if os.name != "posix":
            proc, group = subprocess.Popen(argv, **kwargs), None
        elif sys.version_info >= (3, 11):
            proc, group = self._spawn_in_group(argv, leader, kwargs)
        else:  # Python 3.10 has no process_group: each rank leads a session (and group) of its own
            proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
            group = proc.pid
        self.procs.append(proc)
        self.groups.append(group)
        return proc

    @staticmethod
    def _spawn_in_group(argv: list[str], leader: int | None,
                        kwargs: dict[str, Any]) -> tuple[subprocess.Popen, int]:
        """Rank 0 leads a new process group, the others join it."""
        if leader is not None:
            try:
                return subprocess.Popen(argv, process_group=leader, **kwargs), leader
            except OSError:  # the group is gone (every member exited): a group of its own
                pass
        proc = subprocess.Popen(argv, process_group=0, **kwargs)
        return proc, proc.pid

    def poll(self) -> None:
        """Note every rank that has exited (and when it was first seen)."""
        for rank, p in enumerate(self.procs):
            if p.poll() is not None and rank not in self.exit_seen:
                self.exit_seen[rank] = time.time()

    def running(self) -> list[int]:
        return [rank for rank, p in enumerate(self.procs) if p.poll() is None]

    def stop(self) -> int:
        """SIGKILL every rank still running (stopped ones too: SIGKILL needs no SIGCONT), wait
        for all of them and close their logs. Returns how many were still running."""
        alive = self.running()
        # a group is signalled only while one of its members is unreaped, so its number cannot
        # have been reused by an unrelated group
        for group in {self.groups[r] for r in alive if self.groups[r] is not None}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)  # type: ignore[arg-type]
        for rank in alive:
            with contextlib.suppress(ProcessLookupError):
                self.procs[rank].kill()
        for p in self.procs:
            p.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()
        return len(alive)

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def proc_state(pid: int) -> str | None:
    """The one-letter state Linux shows for ``pid`` (``R``, ``S``, ``T`` stopped, ``Z``...), or
    None where /proc is not available."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses, so split after the last ')'
    fields = stat[stat.rfind(")") + 1:].split()
    return fields[0] if fields else None


class Watchdog:
    """Reads the ranks' heartbeats and process states (at most every :data:`CHECK_INTERVAL_S`)
    and names a rank that stopped responding. Ages are measured on the parent's monotonic clock
    from the last time it saw a heartbeat file change, so clock jumps and a parent that was
    itself suspended do not count against a rank."""

    def __init__(self, folder: str, procs: list[Any],
                 clock: Callable[[], float] = time.monotonic,
                 state: Callable[[int], str | None] = proc_state,
                 stall_s: float | None = STALL_S) -> None:
        self._folder, self._procs, self._clock, self._state = folder, procs, clock, state
        self._stall_s = stall_s
        now = clock()
        # a rank that has not beaten yet is as old as the watchdog (created once ranks spawn)
        self._fresh = [now] * len(procs)
        self._mtime: list[int | None] = [None] * len(procs)
        # progress: rank -> the parent's time it last saw the count change, and the rank's own
        # (monotonic) time of its last progress; ranks that never reported are not counted
        self._progress_mtime: list[int | None] = [None] * len(procs)
        self._progressed: dict[int, float] = {}
        self._last_work: dict[int, tuple[bool, float]] = {}  # (waiting on peers, last work)
        self._stopped_since: dict[int, float] = {}
        self._checked = float("-inf")

    def _look(self, now: float) -> None:
        for rank, p in enumerate(self._procs):
            try:
                mtime = os.stat(Path(self._folder, f"heartbeat.{rank}")).st_mtime_ns
            except OSError:
                mtime = None
            if mtime is not None and mtime != self._mtime[rank]:
                self._mtime[rank], self._fresh[rank] = mtime, now
            self._look_progress(rank, now)
            if p.poll() is None and self._state(p.pid) == "T":
                self._stopped_since.setdefault(rank, now)
            else:
                self._stopped_since.pop(rank, None)

    def _look_progress(self, rank: int, now: float) -> None:
        path = Path(self._folder, f"progress.{rank}")
        try:
            mtime = os.stat(path).st_mtime_ns
            if mtime == self._progress_mtime[rank]:
                return
            _, last, waits = path.read_text().split()
            self._last_work[rank] = (int(waits) > 0, float(last))
        except (OSError, ValueError):  # not written yet
            return
        self._progress_mtime[rank], self._progressed[rank] = mtime, now

    def _stalled(self, now: float, alive: list[int]) -> str | None:
        """Once no running rank progressed for the stall timeout: the rank that progressed last
        longest ago, ranks waiting on their peers in a collective last (they are not the cause)."""
        counted = [r for r in alive if r in self._progressed]
        if self._stall_s is None or not counted or any(
                now - self._progressed[r] < self._stall_s for r in counted):
            return None
        rank = min(counted, key=lambda r: (self._last_work[r], r))
        why = ("every rank waits in a collective, rank {r} the longest" if
               self._last_work[rank][0] else "rank {r} is not waiting in a collective")
        beat = "still beats" if now - self._fresh[rank] < SUSPECT_AGE_S else "is late"
        return (f"rank {rank} stopped making progress (no rank finished any work for "
                f"{self._stall_s:g} s; {why.format(r=rank)}; its heartbeat {beat}: hung)")

    def check(self) -> str | None:
        """One line naming the rank (the longest silent) that stopped responding, or None."""
        now = self._clock()
        if now - self._checked < CHECK_INTERVAL_S:
            return None
        self._checked = now
        self._look(now)
        alive = [r for r, p in enumerate(self._procs) if p.poll() is None]
        stopped = [(since, r) for r, since in self._stopped_since.items()
                   if now - since >= STOPPED_LIMIT_S]
        if stopped:
            _, rank = min(stopped)
            return (f"rank {rank} stopped responding (its process is stopped, e.g. by SIGSTOP, "
                    f"for {STOPPED_LIMIT_S:g} s)")
        silent = [(self._fresh[r], r) for r in alive if now - self._fresh[r] >= HEARTBEAT_STALE_S]
        if silent:
            _, rank = min(silent)
            return (f"rank {rank} stopped responding (no heartbeat for {HEARTBEAT_STALE_S:g} s; "
                    "stopped or hung)")
        return self._stalled(now, alive)

    def suspects(self) -> dict[int, str]:
        """Running ranks that are stopped or whose heartbeat is late (older than
        :data:`SUSPECT_AGE_S`), with why: the likely cause when their peers time out."""
        now = self._clock()
        self._look(now)
        out = {}
        for rank, p in enumerate(self._procs):
            if p.poll() is not None:
                continue
            age = now - self._fresh[rank]
            if rank in self._stopped_since:
                out[rank] = "its process is stopped, e.g. by SIGSTOP"
            elif age >= SUSPECT_AGE_S:
                out[rank] = f"no heartbeat for {age:.0f} s; stopped or hung"
        return out


@dataclass(frozen=True)
class Outcome:
    """How :func:`watch` ended: ``done`` (every rank exited 0), ``failed`` (a rank exited
    non-zero), ``stalled`` (``detail`` names the rank), ``deadline`` or ``terminated`` (the
    parent got SIGTERM or SIGHUP)."""

    kind: str
    detail: str = ""


def watch(ranks: RankProcesses, watchdog: Watchdog, signals: TerminationSignals,
          deadline: float) -> Outcome:
    """Poll the ranks until they all succeed or something ends the run; kills nothing."""
    while True:
        if signals.signum is not None:
            return Outcome("terminated")
        ranks.poll()
        if len(ranks.exit_seen) == len(ranks.procs) and all(
                p.returncode == 0 for p in ranks.procs):
            return Outcome("done")
        if any(p.returncode not in (None, 0) for p in ranks.procs):
            return Outcome("failed")
        stalled = watchdog.check()
        if stalled:
            return Outcome("stalled", stalled)
        if time.monotonic() > deadline:
            return Outcome("deadline")
        time.sleep(POLL_S)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where that is not
    available (other systems: the heartbeat thread's parent check is the fallback)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


#: this rank's finished work: [count, time.monotonic() of the last (:func:`progress`), the
#: collectives it is blocked in (:func:`waiting_on_peers`)]
_work: list[float] = [0, 0.0, 0]


def progress() -> None:
    """Count one finished piece of work (an op, a step, a start-up phase): the parent names the
    rank that stopped making progress when the run hangs. Cheap enough for every op: it only
    counts; the heartbeat thread writes the count out."""
    _work[0] += 1
    _work[1] = time.monotonic()


@contextlib.contextmanager
def waiting_on_peers() -> Iterator[None]:
    """Mark a blocking collective: a rank stalled inside one waits for a peer; the watchdog names
    a rank that is not waiting first."""
    _work[2] += 1
    try:
        yield
    finally:
        _work[2] -= 1


class _Heartbeat(threading.Thread):
    """Touches ``FOLDER/heartbeat.<rank>`` every :data:`HEARTBEAT_INTERVAL_S`, and writes
    ``FOLDER/progress.<rank>`` ("count last-time") when :func:`progress` counted since; exits the
    process when the parent is gone (its pid no longer our parent's) or removed the run's folder."""

    def __init__(self, folder: str, rank: int, parent: int | None) -> None:
        super().__init__(name=f"epsim-heartbeat-{rank}", daemon=True)
        self.path = Path(folder, f"heartbeat.{rank}")
        self.progress_path = Path(folder, f"progress.{rank}")
        self.progress_tmp = Path(folder, f"progress.{rank}.tmp")
        self.written: tuple[float, float] = (0, 0)  # the count and waits last written
        self.parent = parent
        self.silenced = threading.Event()
        self.path.touch()  # the first beat, before the thread starts

    def run(self) -> None:
        while not self.silenced.wait(HEARTBEAT_INTERVAL_S):
            if self.parent is not None and os.getppid() != self.parent:
                os._exit(1)  # orphaned: nobody will collect our results
            try:
                os.utime(self.path)
                self._write_progress()
            except OSError:
                if not self.path.parent.is_dir():
                    os._exit(1)  # the parent removed the run: it is over

    def _write_progress(self) -> None:
        count, last, waits = _work
        if (count, waits) != self.written:
            self.progress_tmp.write_text(f"{count:.0f} {last!r} {waits:.0f}")
            os.replace(self.progress_tmp, self.progress_path)  # the parent never reads half a line
            self.written = (count, waits)


_heartbeat: _Heartbeat | None = None


def worker_start(folder: str, rank: int) -> None:
    """A spawned rank's first act: die with the parent, and start beating."""
    global _heartbeat
    parent = os.environ.get(PARENT_PID_ENV)
    set_parent_death_signal()
    # the parent may have died between our fork and the prctl: then the signal never comes
    if parent is not None and os.getppid() != int(parent):
        os._exit(1)
    _heartbeat = _Heartbeat(folder, rank, int(parent) if parent is not None else None)
    _heartbeat.start()


def silence_heartbeat() -> None:
    """Stop this rank's heartbeat (a test hook: a rank that hangs without beating)."""
    if _heartbeat is not None:
        _heartbeat.silenced.set()
