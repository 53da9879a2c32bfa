"""Starting ranks, running configurations on them, and gathering what they measured (rank 0
summarises the records every rank gathered: ``epsim.runtime.summary``).

Two ways in:
    ``launch_local(options, world)``  spawns ``world`` local rank processes (``python -m
        epsim.runtime.worker``), joined through a file store with gloo (or NCCL with ``device="cuda"``),
        and watches them: the first rank that fails or stops responding ends the run, the others
        are killed, and the failing rank's one-line message comes back as an :class:`EpsimError`;
        SIGTERM or SIGHUP on the parent stops every rank (:class:`RunTerminated`). How the ranks
        are tied to the parent's life is ``epsim.runtime.lifecycle``.
    ``run_rank(options, rank, world, "env://")``  what each rank runs; under ``torchrun`` the
        caller (``epsim run``) calls it directly and torchrun watches the ranks.

Each rank runs every configuration in turn with the same process group (a grid pays for process
start-up once). Before each one, the ranks compare a hash of it and stop when they disagree.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from epsim.model.errors import EpsimError

from . import lifecycle
from .options import RunOptions, validate
from .summary import step_record, summarise

#: a test hook: ``"RANK:STEP"`` raises on that rank before that step, ``"RANK:STEP:kill"`` kills
#: it, ``"RANK:STEP:hang"`` sleeps forever (its heartbeat goes on), ``"RANK:STEP:mute"`` sleeps
#: forever with its heartbeat silenced, ``"RANK:STEP:mark"`` only marks the step; hang, mute and
#: mark first touch ``fault.RANK`` in the working directory (a local rank's: the run's folder), so
#: a test knows the rank is mid-run
FAULT_ENV = "EPSIM_RUNTIME_FAULT"
#: messages of ranks that failed only because a peer went away
#: loopback interface names, in the order tried: Linux's, then macOS's and the BSDs'
LOOPBACK_NAMES = ("lo", "lo0")
_SECONDARY = re.compile(r"connection|closed|reset|broken pipe|timed out|timeout|peer|"
                        r"socket|gloo|nccl|abort", re.IGNORECASE)


class RunTerminated(EpsimError):
    """The launching parent got SIGTERM (or SIGHUP) and stopped its ranks. ``exit_status`` is
    the shell's convention for death by that signal (128 + its number: 143 for SIGTERM), which
    the command line exits with instead of 2."""

    exit_status = 143

    def __init__(self, signum: int, stopped: int) -> None:
        super().__init__(f"terminated by {lifecycle.signal_name(signum)}; {stopped} rank"
                         f"{'' if stopped == 1 else 's'} stopped")
        self.signum = signum
        self.exit_status = 128 + signum


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS and the BSDs), or None
    where neither exists."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:  # no interface listing on this system
        return None
    return next((name for name in LOOPBACK_NAMES if name in names), None)


def local_rank_environment() -> dict[str, str]:
    """The environment of a locally spawned rank process: one compute thread (ranks share the
    cores), its sockets on the loopback interface, and no torchrun variables leaking in from a
    parent launch. A rank imports the installed ``epsim`` (editable or not), like its parent; it
    runs in the launch's temporary folder, so no source tree in the user's working directory
    shadows the installed package.

    gloo (and NCCL's bootstrap) otherwise bind to the address the hostname resolves to, which on
    a machine whose hostname maps to its network address would expose a purely local run to the
    network; the ranks rendezvous through a file store, so no other socket is opened. A user's
    own ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (set for multi-node runs) is overridden
    here: a local run stays local."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    lo = loopback_interface()
    if lo is not None:
        env.update(GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo)
    return env


def under_torchrun() -> bool:
    """Started by ``torchrun`` (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------


def _inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if int(parts[0]) == rank and int(parts[1]) == step:
        mode = parts[2] if len(parts) > 2 else "raise"
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode in ("hang", "mute", "mark"):
            Path(f"fault.{rank}").touch()
            if mode == "mark":
                return
            if mode == "mute":
                lifecycle.silence_heartbeat()
            while True:
                time.sleep(60)
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")


def _agree(opts: RunOptions, rank: int, world: int) -> None:
    """Stop every rank when they were started with different configurations."""
    import torch
    import torch.distributed as dist

    mine = (opts.digest(), torch.__version__)
    everyone: list[Any] = [None] * world
    with lifecycle.waiting_on_peers():
        dist.all_gather_object(everyone, mine)
    differing = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if differing:
        raise EpsimError(
            f"ranks disagree on the configuration: rank(s) {differing} differ from rank 0 "
            f"(config hash {everyone[differing[0]][0]} vs {everyone[0][0]}); start every rank "
            "with the same arguments")


def run_one(opts: RunOptions, rank: int, world: int) -> dict[str, Any] | None:
    """Run one configuration on this rank; rank 0 returns the summary, the others None."""
    import torch.distributed as dist

    from .executor import RankRuntime

    _agree(opts, rank, world)
    model, plan, placement = validate(opts)
    rt = RankRuntime(opts, model, plan, placement, rank)
    captured = None
    if opts.capture:
        from .capture import CapturedDecode

        captured = CapturedDecode(rt)
    steps: list[dict[str, Any]] = []
    if opts.prefill:
        _inject_fault(rank, -1)
        steps.append(step_record(opts, rt.prefill(), phase="prefill"))
    for step in range(opts.steps):
        _inject_fault(rank, step)
        if captured is None:
            result = rt.step()
        else:
            result = captured.first() if step == 0 else captured.replay()
        writes = rt.cache.take_journal() if rt.cache.journal is not None else None
        steps.append(step_record(opts, result, writes=writes))
        lifecycle.progress()
    # --check compares the reference with the cache as stored (runtime.reference's docstring)
    cache = rt.cache.widened() if opts.check else None
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    with lifecycle.waiting_on_peers():
        dist.gather_object((steps, cache), gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    summary = summarise(opts, model, [s for s, _ in gathered],
                        [c for _, c in gathered] if opts.check else None)
    summary["redundant_experts"] = plan.redundant_experts
    return summary


def run_rank(options: list[RunOptions], rank: int, world: int, init_method: str,
             timeout_s: float = 120.0) -> list[dict[str, Any]] | None:
    """Join the process group, run every configuration, leave. Rank 0 returns the summaries."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the machine's cores
    device = options[0].device if options else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise EpsimError("--device cuda but torch sees no GPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    lifecycle.progress()  # joined: from here on the watchdog counts this rank's progress
    try:
        results = [run_one(opts, rank, world) for opts in options]
        with lifecycle.waiting_on_peers():
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return results if rank == 0 else None  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Local spawning
# --------------------------------------------------------------------------------------------


def worker_main(folder: str, rank: int) -> int:
    """``python -m epsim.runtime.worker FOLDER RANK``: one spawned rank; errors go to FOLDER."""
    lifecycle.worker_start(folder, rank)
    spec = json.loads(Path(folder, "spec.json").read_text())
    try:
        options = [RunOptions(**o) for o in spec["options"]]
        results = run_rank(options, rank, spec["world"], spec["init"], spec["timeout_s"])
        if rank == 0:
            tmp = Path(folder, "result.pkl.tmp")
            tmp.write_bytes(pickle.dumps(results))
            os.replace(tmp, Path(folder, "result.pkl"))
        return 0
    except BaseException as exc:  # report every failure, then exit non-zero
        message = str(exc) if isinstance(exc, EpsimError) else f"{type(exc).__name__}: {exc}"
        message = " ".join(message.split())[:500]
        Path(folder, f"error.{rank}").write_text(json.dumps(
            {"rank": rank, "time": time.time(), "message": message,
             "user_error": isinstance(exc, EpsimError)}))
        sys.stderr.write(f"rank {rank}: {message}\n")
        return 2 if isinstance(exc, EpsimError) else 1


def launch_local(options: list[RunOptions], world: int, timeout_s: float = 120.0,
                 deadline_s: float | None = None,
                 stall_s: float = lifecycle.STALL_S) -> list[dict[str, Any]]:
    """Spawn ``world`` local ranks, run ``options`` on them, return rank 0's summaries.

    Raises:
        EpsimError: a rank failed, stopped responding or stopped making progress (no rank
            finished any work for ``stall_s``; the message names the rank, the earliest root
            cause first) or the run passed ``deadline_s`` (default ``4 * timeout_s``).
        RunTerminated: the parent got SIGTERM or SIGHUP during the launch (ranks stopped, the
            run's folder removed).
    """
    # ranks run in a temporary folder: paths the user gave relative to their own directory
    options = [_with_absolute_paths(o) for o in options]
    for opts in options:
        validate(opts)  # bad input: one line here, before any process starts
        if opts.world_size != world:
            raise EpsimError(f"options for world size {opts.world_size} in a {world}-rank launch")
    deadline = time.monotonic() + (deadline_s if deadline_s is not None else 4 * timeout_s)
    # exits in reverse order: ranks stopped, then the folder removed, then the handlers restored
    with lifecycle.TerminationSignals() as signals, \
            lifecycle.run_folder("epsim-run-") as folder, lifecycle.RankProcesses() as ranks:
        spec = {"options": [o.to_json() for o in options], "world": world,
                "timeout_s": timeout_s, "init": f"file://{folder}/store"}
        Path(folder, "spec.json").write_text(json.dumps(spec))
        env = local_rank_environment()
        for rank in range(world):
            if signals.signum is not None:
                break  # _watch reports it
            ranks.spawn([sys.executable, "-m", "epsim.runtime.worker", folder, str(rank)],
                        env=env, cwd=folder, log_path=Path(folder, f"stderr.{rank}"))
        failure = _watch(ranks, folder, deadline, signals, stall_s)
        if failure:
            raise EpsimError(failure)
        result = Path(folder, "result.pkl")
        if not result.is_file():
            raise EpsimError("rank 0 ended without writing its results")
        results = pickle.loads(result.read_bytes())
    if signals.signum is not None:  # arrived after the ranks had finished
        raise RunTerminated(signals.signum, 0)
    return results


def _with_absolute_paths(opts: RunOptions) -> RunOptions:
    """``opts`` with a model config path and a placement path made absolute (shipped model
    names stay names)."""
    changes: dict[str, str] = {}
    if opts.placement:
        changes["placement"] = os.path.abspath(opts.placement)
    if Path(opts.model).exists():
        changes["model"] = os.path.abspath(opts.model)
    return opts.with_(**changes) if changes else opts


def _watch(ranks: lifecycle.RankProcesses, folder: str, deadline: float,
           signals: lifecycle.TerminationSignals, stall_s: float) -> str | None:
    """Watch the ranks; when the run ends early kill them all and return the root-cause message
    (or raise :class:`RunTerminated`)."""
    watchdog = lifecycle.Watchdog(folder, ranks.procs, stall_s=stall_s)
    outcome = lifecycle.watch(ranks, watchdog, signals, deadline)
    if outcome.kind == "done":
        return None
    if outcome.kind == "terminated":
        assert signals.signum is not None
        raise RunTerminated(signals.signum, ranks.stop())
    if outcome.kind == "stalled":
        ranks.stop()
        return outcome.detail
    if outcome.kind == "deadline":
        ranks.stop()
        return "the run passed its deadline; ranks killed (raise --timeout for longer runs)"
    time.sleep(0.3)  # let the other ranks' reports land, then stop everyone
    # a rank that is stopped, silent or still running while its peers failed waiting is likely
    # why they failed
    suspects = watchdog.suspects()
    for rank in ranks.running():
        if not Path(folder, f"error.{rank}").is_file():
            suspects.setdefault(rank, "still running when its peers gave up on it; hung")
    ranks.stop()
    return _root_cause(ranks.procs, folder, ranks.exit_seen, suspects)


def _root_cause(procs: list[subprocess.Popen], folder: str, exit_seen: dict[int, float],
                suspects: dict[int, str] | None = None) -> str:
    """The run's one-line failure: the earliest primary report; when every report is secondary
    (peers timed out or lost their connection) a stopped or silent rank among ``suspects``
    (rank -> why) is the cause, not the peers that gave up waiting for it."""
    reports = []
    for rank, p in enumerate(procs):
        err = Path(folder, f"error.{rank}")
        if err.is_file():
            info = json.loads(err.read_text())
            secondary = bool(_SECONDARY.search(info["message"])) and not info["user_error"]
            reports.append((secondary, info["time"], rank, info["message"]))
        elif p.returncode not in (None, 0) and rank in exit_seen:
            code = p.returncode
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            reports.append((False, exit_seen[rank], rank, f"{how} without a report"))
    reports.sort()
    if suspects and (not reports or reports[0][0]):
        rank = min(suspects)
        waited = f"; {len(reports)} other rank(s) failed waiting for it" if reports else ""
        return f"rank {rank} stopped responding ({suspects[rank]}){waited}"
    if not reports:
        return "a rank failed without a report"
    _, _, rank, message = reports[0]
    others = len(reports) - 1
    tail = f" ({others} other rank(s) stopped after it)" if others else ""
    return f"rank {rank} failed: {message}{tail}"
