"""Starting ranks, running configurations on them, and gathering what they measured.

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
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from epsim.model.errors import EpsimError

from . import lifecycle
from .options import RunOptions, validate

#: a test hook: ``"RANK:STEP"`` raises on that rank before that step, ``"RANK:STEP:kill"`` kills
#: it, ``"RANK:STEP:hang"`` sleeps forever (its heartbeat goes on), ``"RANK:STEP:mute"`` sleeps
#: forever with its heartbeat silenced, ``"RANK:STEP:mark"`` only marks the step; hang, mute and
#: mark first touch ``fault.RANK`` in the working directory (a local rank's: the run's folder), so
#: a test knows the rank is mid-run
FAULT_ENV = "EPSIM_RUNTIME_FAULT"
#: messages of ranks that failed only because a peer went away
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


def local_rank_environment() -> dict[str, str]:
    """The environment of a locally spawned rank process: one compute thread (ranks share the
    cores) and no torchrun variables leaking in from a parent launch. A rank imports the
    installed ``epsim`` (editable or not), like its parent; it runs in the launch's temporary
    folder, so no source tree in the user's working directory shadows the installed package."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def under_torchrun() -> bool:
    """Started by ``torchrun`` (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def percentiles(values: list[float]) -> dict[str, float]:
    """``{mean, median, p10, p90}`` (linear interpolation, as numpy's default)."""
    xs = sorted(values)

    def q(f: float) -> float:
        pos = f * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "median": q(0.5), "p10": q(0.1), "p90": q(0.9)}


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
        steps.append(_record(opts, rt.prefill(), phase="prefill"))
    for step in range(opts.steps):
        _inject_fault(rank, step)
        if captured is None:
            result = rt.step()
        else:
            result = captured.first() if step == 0 else captured.replay()
        writes = rt.cache.take_journal() if rt.cache.journal is not None else None
        steps.append(_record(opts, result, writes=writes))
    # --check compares the reference with the cache as stored (runtime.reference's docstring)
    cache = rt.cache.widened() if opts.check else None
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((steps, cache), gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    summary = summarise(opts, model, [s for s, _ in gathered],
                        [c for _, c in gathered] if opts.check else None)
    summary["redundant_experts"] = plan.redundant_experts
    return summary


def _record(opts: RunOptions, result: Any, phase: str = "decode",
            writes: dict[Any, Any] | None = None) -> dict[str, Any]:
    record = {
        "phase": phase,
        "step_us": result.step_us,
        "logits": result.logits.cpu() if opts.check else None,
        "next_tokens": result.next_tokens.cpu(),
        "hidden": result.hidden.cpu() if opts.check else None,
        "events": result.events if opts.trace else [],
        "op_us": _op_us(result.events),
    }
    if opts.mtp:  # the verify step's draft passes and its simulated acceptance
        record.update(
            accepted=result.accepted.cpu(), draft_tokens=result.draft_tokens.cpu(),
            draft_logits=[x.cpu() for x in result.draft_logits] if opts.check else None,
            kv_writes=writes)
    return record


def _op_us(events: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in events:
        out[e.kind] = out.get(e.kind, 0.0) + e.dur_us
    return out


def _split(records: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """A rank's records -> (its prefill record or None, its decode steps)."""
    if records and records[0]["phase"] == "prefill":
        return records[0], records[1:]
    return None, records


def summarise(opts: RunOptions, model: Any, per_rank: list[list[dict[str, Any]]],
              caches: list[tuple[Any, Any]] | None = None) -> dict[str, Any]:
    """The run's figures from every rank's per-step records (rank 0 only); ``caches``: each
    rank's KV cache after the run (``--check``)."""
    world = len(per_rank)
    split = [_split(records) for records in per_rank]
    prefills = [p for p, _ in split]
    decode = [d for _, d in split]
    # a step takes as long as its slowest rank; the first step warms up when there are others
    step_ms = [max(decode[r][s]["step_us"] for r in range(world)) / 1e3
               for s in range(opts.steps)]
    timed = step_ms[1:] if len(step_ms) > 1 else step_ms
    stats = percentiles(timed)
    kinds = sorted({k for rank in decode for st in rank for k in st["op_us"]})
    out: dict[str, Any] = {
        "model": model.name,
        "world_size": world,
        "batch_per_rank": opts.batch,
        "context": opts.context,
        "steps": opts.steps,
        "steps_timed": len(timed),
        "dbo": opts.dbo,
        "static": opts.static_shapes,
        "capture": opts.capture,
        "kv_dtype": opts.kv_dtype,
        "dtype": opts.dtype,
        "device": opts.device,
        "placement": opts.placement or ("table" if opts.placement_table is not None
                                        else "contiguous"),
        "unfused": opts.unfused,
        "prefill": opts.prefill,
        "step_ms": stats,
        "step_ms_per_step": step_ms,  # every step, warm-up included (the slowest rank's)
        # each rank's own: how far the slowest lags the others (epsim calibrate's rank skew)
        "step_ms_per_rank": [[st["step_us"] / 1e3 for st in rank] for rank in decode],
        "tokens_per_s": _emitted_per_step(opts, decode, world) / (stats["mean"] / 1e3),
        "op_ms_per_step_by_kind": {
            k: sum(st["op_us"].get(k, 0.0) for rank in decode for st in rank)
            / (world * opts.steps) / 1e3 for k in kinds},
        "next_tokens": [[st["next_tokens"].tolist() for st in rank] for rank in decode],
    }
    if opts.mtp:
        accepted = [sum(int(st["accepted"].sum()) for st in (rank[s] for rank in decode))
                    for s in range(opts.steps)]
        out["mtp"] = {"draft_tokens": opts.mtp, "acceptance": opts.mtp_acceptance,
                      "accepted_per_step": accepted,
                      "tokens_per_request_step": 1 + sum(accepted) / (world * opts.batch
                                                                      * opts.steps)}
    prefill_ms = 0.0
    if opts.prefill:
        prefill_ms = max(p["step_us"] for p in prefills if p is not None) / 1e3
        out["prefill_ms"] = prefill_ms
        out["prefill_tokens_per_s"] = world * opts.batch * (opts.context - 1) / (prefill_ms / 1e3)
    if opts.trace:
        # prefill first (step -1), then the decode steps one after another
        out["trace_events"] = [
            _shift(e, -1, 0.0) for p in prefills if p is not None for e in p["events"]] + [
            _shift(e, s, prefill_ms + sum(step_ms[:s]))
            for rank in decode for s, st in enumerate(rank) for e in st["events"]]
    if opts.check:
        assert caches is not None, "--check needs every rank's KV cache"
        out.update(check_against_reference(opts, model, prefills, decode, caches))
    return out


def _emitted_per_step(opts: RunOptions, decode: list[list[dict[str, Any]]],
                      world: int) -> float:
    """Tokens the ranks emit per timed step: one per sequence, plus its accepted drafts under
    MTP (the warm-up step is not timed when there are others)."""
    if not opts.mtp:
        return world * opts.batch
    timed = range(1, opts.steps) if opts.steps > 1 else range(opts.steps)
    emitted = [world * opts.batch + sum(int(rank[s]["accepted"].sum()) for rank in decode)
               for s in timed]
    return sum(emitted) / len(emitted)


def _shift(event: Any, step: int, offset_ms: float) -> Any:
    from dataclasses import replace

    return replace(event, start_us=event.start_us + offset_ms * 1e3,
                   args={**dict(event.args), "step": step})


def check_against_reference(opts: RunOptions, model: Any, prefills: list[dict[str, Any] | None],
                            decode: list[list[dict[str, Any]]],
                            caches: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Compare every rank's logits, final hidden states, tokens and stored KV cache with the
    dense reference (which decodes from the cache as the ranks stored it)."""
    import torch

    from .reference import StoredCache, reference_decode, relative_error

    world, b = len(decode), opts.batch
    stored = StoredCache(torch.cat([c for c, _ in caches], dim=1),
                         torch.cat([pe for _, pe in caches], dim=1))
    writes = _step_writes(decode, b) if opts.mtp else None
    run = reference_decode(model, opts.seed, world, b, opts.context, opts.steps, opts.kv_dtype,
                           prefill=opts.prefill, stored=stored, mtp=opts.mtp,
                           acceptance=opts.mtp_acceptance, writes=writes)
    ref_prefill, ref = run.prefill, run.decode
    errs = {"logits": 0.0, "hidden": 0.0, "kv_cache": run.kv_cache_err}
    if opts.mtp:
        errs["draft_logits"] = 0.0
    mismatches = 0
    q = 1 + opts.mtp  # rows per sequence of a verify step
    for r in range(world):
        rows, seqs = slice(r * b * q, (r + 1) * b * q), slice(r * b, (r + 1) * b)
        pairs = list(zip(decode[r], ref, strict=True))
        if ref_prefill is not None:
            pairs.append((prefills[r], ref_prefill))
        for got, want in pairs:
            part = seqs if got["phase"] == "prefill" else rows
            errs["logits"] = max(errs["logits"], relative_error(got["logits"], want.logits[part]))
            errs["hidden"] = max(errs["hidden"], relative_error(got["hidden"], want.hidden[part]))
            mismatches += int((got["next_tokens"] != want.next_tokens[part]).sum())
        for got, want in zip(decode[r], run.drafts, strict=True) if opts.mtp else ():
            # MTP: the draft passes
            for logits, ref_logits in zip(got["draft_logits"], want.logits, strict=True):
                errs["draft_logits"] = max(errs["draft_logits"],
                                           relative_error(logits, ref_logits[seqs]))
            mismatches += int((got["draft_tokens"] != want.tokens[seqs]).sum())
    return {"max_rel_err": max(errs.values()), "max_rel_err_by_output": errs,
            "token_mismatches": mismatches}


def _step_writes(decode: list[list[dict[str, Any]]], batch: int) -> list[Any]:
    """Each step's cache writes of every rank, sequences numbered rank by rank."""
    import torch

    from .reference import StepWrites

    out = []
    for s in range(len(decode[0])):
        merged: dict[Any, list[Any]] = {}
        for r, rank in enumerate(decode):
            for key, (seq, pos, c, pe) in rank[s]["kv_writes"].items():
                merged.setdefault(key, []).append((seq + r * batch, pos, c, pe))
        out.append(StepWrites({key: tuple(torch.cat(x) for x in zip(*parts, strict=True))
                               for key, parts in merged.items()}))
    return out


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
    try:
        results = [run_one(opts, rank, world) for opts in options]
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
                 deadline_s: float | None = None) -> list[dict[str, Any]]:
    """Spawn ``world`` local ranks, run ``options`` on them, return rank 0's summaries.

    Raises:
        EpsimError: a rank failed or stopped responding (its message, the earliest root cause
            first) or the run passed ``deadline_s`` (default ``4 * timeout_s``).
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
        failure = _watch(ranks, folder, deadline, signals)
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
           signals: lifecycle.TerminationSignals) -> str | None:
    """Watch the ranks; when the run ends early kill them all and return the root-cause message
    (or raise :class:`RunTerminated`)."""
    watchdog = lifecycle.Watchdog(folder, ranks.procs)
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
