"""Multi-rank microbenchmarks: the runtime's EP exchange over message sizes, and contention.

``comm_sweep(world)`` spawns ``world`` local ranks (``python -m epsim.calibrate.comm_bench FOLDER
RANK``, gloo over a file store, one thread each, with ``epsim.runtime.lifecycle`` as
``epsim.runtime.launch`` starts them: one process group, dying with the parent, heartbeats)
that measure:

* ``a2a``: the runtime's own ``epsim.runtime.comm.dispatch_dynamic`` and ``combine_dynamic`` (count
  exchange, rows and metadata) over tokens per rank, each issued after ``busy_rounds`` of the
  contention probe (about 1 ms of compute, as a decode step computes between exchanges) and
  timed from issue to the end of its wait, so waiting for peers that are still computing (ranks
  time-sliced on shared cores) counts, as it does in the runtime; a repeat's time is the slowest
  rank's. Rows carry the bytes the simulator
  charges the busiest link (graph's ``bytes_per_token`` times the nominal rows per peer).
  Each exchange's call is timed too (``host_s``): how long it holds the issuing thread before
  it returns (the dispatch's blocking count exchange; the combine's asynchronous call, which
  returns only once gloo's threads and the rank's main thread have had a core), the time an
  eager host cannot issue the next op.
* ``contention``: a fixed probe of runtime kernels (RMSNorm, a skinny GEMM, SiLU) run by every
  rank at once, alone and while a large all-to-all is in flight on every rank. Set against the
  same probe in one process (``probe_alone``), this gives how the ranks share the cores and how
  much an exchange in flight slows compute.

torch is imported inside the rank processes only.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from epsim.model.dtypes import bytes_per_element
from epsim.model.errors import EpsimError
from epsim.model.graph_builder import prob_rank_hit
from epsim.runtime import lifecycle

#: the exchange benchmark's model-like sizes (disjoint from the shipped tiny models' hidden sizes)
A2A_HIDDEN = 128
A2A_EXPERTS = 24
A2A_TOP_K = 4
A2A_TOKENS: tuple[int, ...] = (1, 16, 128, 1024, 3072)
QUICK_A2A_TOKENS: tuple[int, ...] = (8, 768)
DISPATCH_DTYPE = "fp8_token128"  # model.plan.ParallelPlan's default: what the graph charges


def bytes_per_token(kind: str, hidden: int = A2A_HIDDEN, top_k: int = A2A_TOP_K) -> float:
    """Bytes per token row the op graph charges a dispatch (FP8 rows + metadata) or a combine
    (bf16 rows), as ``epsim.model.graph`` computes them."""
    if kind == "dispatch":
        return hidden * bytes_per_element(DISPATCH_DTYPE) + top_k * 8
    return hidden * bytes_per_element("bf16")


def link_bytes(kind: str, tokens: int, world: int) -> float:
    """Bytes on the busiest link under nominal (uniform) routing, as the simulator charges."""
    hit = prob_rank_hit(A2A_EXPERTS, A2A_EXPERTS // world, A2A_TOP_K)
    return tokens * hit * bytes_per_token(kind)


# --------------------------------------------------------------------------------------------
# inside a rank
# --------------------------------------------------------------------------------------------


def _probe(torch: Any, x: Any, w: Any, norm_w: Any, rounds: int) -> float:
    """Seconds for ``rounds`` of (RMSNorm, GEMM, SiLU-and-mul) through epsim.runtime.kernels."""
    from epsim.runtime import kernels

    t0 = time.perf_counter()
    for _ in range(rounds):
        h = kernels.rms_norm(x, norm_w, 1e-6)
        y = h @ w
        kernels.silu_and_mul(y)
    return time.perf_counter() - t0


def probe_inputs(torch: Any) -> tuple[Any, Any, Any]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(16, 256, generator=gen), torch.randn(256, 512, generator=gen),
            torch.ones(256))


def _rank_main(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from epsim.runtime import comm

    torch.set_num_threads(1)
    world = spec["world"]
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=world)
    out: dict[str, Any] = {"a2a": [], "contention": {}}
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        slots_per_rank = A2A_EXPERTS // world
        reps = spec["repeats"]
        px, pw, pnw = probe_inputs(torch)
        busy = spec["busy_rounds"]
        for tokens in spec["tokens"]:
            x = torch.randn(tokens, A2A_HIDDEN, generator=gen)
            # each token's top-k distinct experts, uniform (slots = experts, contiguous)
            slots = torch.stack([torch.randperm(A2A_EXPERTS, generator=gen)[:A2A_TOP_K]
                                 for _ in range(tokens)])
            weights = torch.rand(tokens, A2A_TOP_K, generator=gen)
            for rep in range(reps + 2):
                # as in a decode step: every rank computes, then exchanges; a rank's time from
                # issue to the end of its wait includes waiting for peers still computing
                # (time-sliced when the ranks outnumber the cores)
                dist.barrier()
                _probe(torch, px, pw, pnw, busy)
                t0 = time.perf_counter()
                pending = comm.dispatch_dynamic(x, slots, weights, slots_per_rank)
                tc = time.perf_counter()  # the call returned: its blocking count exchange done
                recv = pending.wait()
                t1 = time.perf_counter()
                _probe(torch, px, pw, pnw, busy)
                t2 = time.perf_counter()
                pending = comm.combine_dynamic(recv.x, recv.layout)
                ti = time.perf_counter()  # the asynchronous call returned
                pending.wait()
                t3 = time.perf_counter()
                if rep >= 2:
                    out["a2a"].append({"tokens": tokens, "rep": rep, "dispatch_s": t1 - t0,
                                       "dispatch_host_s": tc - t0, "combine_s": t3 - t2,
                                       "combine_host_s": ti - t2})
        # contention: every rank runs the probe at once, then again under a large exchange
        x, w, nw = probe_inputs(torch)
        rounds = spec["probe_rounds"]
        _probe(torch, x, w, nw, 3)
        together, under_comm, comm_alone, alone = [], [], [], []
        big = torch.randn(world * spec["comm_rows"], 256, generator=gen)
        back = torch.empty_like(big)
        for _ in range(spec["probe_repeats"]):
            # rank 0 alone while the others wait in the barrier (the unshared reference, taken
            # under the same background load), then every rank at once
            dist.barrier()
            if rank == 0:
                alone.append(_probe(torch, x, w, nw, rounds))
            dist.barrier()
            together.append(_probe(torch, x, w, nw, rounds))
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(back, big)
            comm_alone.append(time.perf_counter() - t0)
            dist.barrier()
            work = dist.all_to_all_single(back, big, async_op=True)
            under_comm.append(_probe(torch, x, w, nw, rounds))
            work.wait()
        out["contention"] = {"alone_s": alone, "together_s": together, "under_comm_s": under_comm,
                             "comm_alone_s": comm_alone}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"ranks": gathered}


def worker_main(folder: str, rank: int) -> int:
    lifecycle.worker_start(folder, rank)
    spec = json.loads(Path(folder, "spec.json").read_text())
    try:
        result = _rank_main(spec, rank)
        if rank == 0:
            tmp = Path(folder, "result.json.tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, Path(folder, "result.json"))
        return 0
    except BaseException as exc:  # report, then exit non-zero
        Path(folder, f"error.{rank}").write_text(f"{type(exc).__name__}: {exc}")
        return 1


# --------------------------------------------------------------------------------------------
# the launching process
# --------------------------------------------------------------------------------------------


def run_ranks(world: int, tokens: tuple[int, ...], repeats: int, probe_rounds: int,
              probe_repeats: int, comm_rows: int, busy_rounds: int,
              timeout_s: float = 300.0) -> dict[str, Any]:
    """Spawn ``world`` ranks running the benchmarks; rank 0's gathered results.

    Raises:
        EpsimError: a rank failed or stopped responding, or the deadline passed.
        RunTerminated: the parent got SIGTERM or SIGHUP (ranks stopped, folder removed).
    """
    from epsim.runtime.launch import RunTerminated, local_rank_environment

    with lifecycle.TerminationSignals() as signals, \
            lifecycle.run_folder("epsim-calib-") as folder, lifecycle.RankProcesses() as ranks:
        spec = {"world": world, "init": f"file://{folder}/store", "tokens": list(tokens),
                "repeats": repeats, "probe_rounds": probe_rounds,
                "probe_repeats": probe_repeats, "comm_rows": comm_rows,
                "busy_rounds": busy_rounds}
        Path(folder, "spec.json").write_text(json.dumps(spec))
        env = local_rank_environment()
        for r in range(world):
            if signals.signum is None:
                ranks.spawn([sys.executable, "-m", "epsim.calibrate.comm_bench", folder, str(r)],
                            env=env, cwd=folder)
        outcome = lifecycle.watch(ranks, lifecycle.Watchdog(folder, ranks.procs), signals,
                                  time.monotonic() + timeout_s)
        if outcome.kind == "terminated":
            assert signals.signum is not None
            raise RunTerminated(signals.signum, ranks.stop())
        ranks.stop()
        if outcome.kind == "stalled":
            raise EpsimError(f"the {world}-rank calibration benchmark: {outcome.detail}")
        errors = sorted(Path(folder).glob("error.*"))
        if errors:
            raise EpsimError(f"calibration rank failed: {errors[0].read_text()[:300]}")
        result = Path(folder, "result.json")
        if not result.is_file():
            raise EpsimError(f"the {world}-rank calibration benchmark ended without results "
                             "(deadline passed or a rank was killed)")
        results = json.loads(result.read_text())
    if signals.signum is not None:  # arrived after the ranks had finished
        raise RunTerminated(signals.signum, 0)
    return results


def _per_repeat(gathered: list[Any], tokens: int, column: str, over_ranks: Any
                ) -> list[float]:
    """Sorted per-repeat times of ``column`` at ``tokens``, each ``over_ranks`` (max: the
    slowest rank's, min: the last to arrive's, fmean: the average rank's) of the ranks'
    (``gathered``: per round, every rank's results)."""
    times = []
    for ranks in gathered:
        per_rep: dict[int, list[float]] = {}
        for r in ranks:
            for row in r["a2a"]:
                if row["tokens"] == tokens:
                    per_rep.setdefault(row["rep"], []).append(row[column])
        times.extend(over_ranks(v) for v in per_rep.values())
    return sorted(times)


def comm_sweep(worlds: tuple[int, ...] = (2, 4), tokens: tuple[int, ...] = A2A_TOKENS,
               repeats: int = 20, probe_rounds: int = 40, probe_repeats: int = 7,
               comm_rows: int = 8192, busy_rounds: int = 10, rounds: int = 2,
               before_launch: Any = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run the exchange and contention benchmarks at each world size (``before_launch``, a
    callable, runs before each launch: the machine probe).

    Returns:
        ``a2a``: one row per (world, kind, tokens): ``time_s`` (median over repeats of the slowest
        rank), ``p10_s``, ``p90_s``, ``link_bytes`` (the busiest link's bytes as the simulator
        charges them), ``peers`` (world - 1), ``last_s`` (median over repeats of the least rank
        time: the last rank to arrive waits only for the exchange itself, no peer), ``host_s``
        (the time inside the call that issues the exchange: the least rank's for a dispatch,
        whose call ends with the count exchange, the ranks' mean for a combine).
        ``contention``: one row per world size: ``alone_s`` (median probe time of rank 0 while
        the others wait), ``probe_s`` (every rank at once, median over ranks and repeats),
        ``probe_under_comm_s`` (the same with a large all-to-all in flight), ``comm_alone_s``
        (that all-to-all alone).
    """
    a2a_rows: list[dict[str, Any]] = []
    cont_rows: list[dict[str, Any]] = []
    gathered: dict[int, list[Any]] = {w: [] for w in worlds}
    for _ in range(rounds):  # rounds alternate the world sizes (background load is bursty)
        for world in worlds:
            if before_launch is not None:
                before_launch()
            gathered[world].append(run_ranks(world, tokens, repeats, probe_rounds,
                                             probe_repeats, comm_rows, busy_rounds)["ranks"])
    for world in worlds:
        for kind in ("dispatch", "combine"):
            for t in tokens:
                times = _per_repeat(gathered[world], t, f"{kind}_s", max)
                last = _per_repeat(gathered[world], t, f"{kind}_s", min)
                # the dispatch's call ends with its count exchange, a meeting of every rank: the
                # last to arrive waits least (the straggler is added by the fit); the combine's
                # call is each rank's own, held while its threads wait for a core: the average
                host = _per_repeat(gathered[world], t, f"{kind}_host_s",
                                   min if kind == "dispatch" else statistics.fmean)
                a2a_rows.append({"world": world, "kind": kind, "tokens": t,
                                 "peers": world - 1, "link_bytes": link_bytes(kind, t, world),
                                 "time_s": statistics.median(times), "p10_s": times[0],
                                 "p90_s": times[-1], "repeats": len(times),
                                 "last_s": statistics.median(last),
                                 "host_s": statistics.median(host)})
        cont = [r["contention"] for ranks in gathered[world] for r in ranks]
        cont_rows.append({
            "world": world,
            "alone_s": statistics.median([v for c in cont for v in c["alone_s"]]),
            "probe_s": statistics.median([v for c in cont for v in c["together_s"]]),
            "probe_under_comm_s": statistics.median([v for c in cont for v in c["under_comm_s"]]),
            "comm_alone_s": statistics.median([v for c in cont for v in c["comm_alone_s"]]),
        })
    return pd.DataFrame(a2a_rows), pd.DataFrame(cont_rows)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], int(sys.argv[2])))
