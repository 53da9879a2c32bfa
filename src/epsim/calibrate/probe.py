"""A machine-state probe: how fast the machine's cores run plain compute right now.

Other jobs on a shared machine take cores from the runs that calibration and validation time, so
the same configuration measures differently a minute apart. ``core_probe`` runs one fixed piece
of plain Python arithmetic (no torch, no model, no exchange: it shares nothing with any grid
configuration) in as many processes as the machine has cores, all at once, and returns the
median wall time. ``epsim calibrate`` records it around its sweeps (``calibration.probe``);
``epsim validate`` runs it again before each launch and reports the ratio (``machine_probe``).

How a ratio moves a case (``load_factor``): with ``C`` cores, a probe of ``C`` processes that
runs ``f`` times as long as at calibration saw ``L = C (f - 1)`` more runnable threads than then
(processor sharing: ``C`` threads among ``C + L``). ``W`` ranks sharing the cores with them run
``1 + L / max(W, C)`` times as long (``W + L`` threads on ``C`` cores against ``W``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
from typing import Any

from epsim.model.errors import EpsimError

#: iterations of the probe's loop: about 20 ms of one core
PROBE_LOOP = 200_000
PROBE_REPEATS = 5


def _spin(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1_000_003
    return acc


def _worker(barrier: Any, out: Any, loop: int, repeats: int) -> None:
    walls = []
    for _ in range(repeats):
        barrier.wait()
        t0 = time.perf_counter()
        _spin(loop)
        walls.append(time.perf_counter() - t0)
    out.put(walls)


def core_probe(processes: int | None = None, loop: int = PROBE_LOOP,
               repeats: int = PROBE_REPEATS) -> float:
    """Median wall seconds of the probe loop run by ``processes`` (default: the machine's
    cores) processes at once, over ``repeats`` rounds."""
    n = processes or os.cpu_count() or 1
    ctx = mp.get_context("spawn")  # no state of the caller (torch threads) in the workers
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(barrier, out, loop, repeats), daemon=True)
             for _ in range(n)]
    try:
        for p in procs:
            p.start()
        walls = [w for _ in procs for w in out.get(timeout=120)]
    except (OSError, queue.Empty) as exc:
        for p in procs:
            if p.is_alive():
                p.terminate()
        raise EpsimError(f"the machine probe failed ({type(exc).__name__}: its {n} worker "
                         "processes did not start or report within 120 s)") from None
    for p in procs:
        p.join(timeout=10)
    return float(statistics.median(walls))


def probe_record(samples: list[float]) -> dict[str, Any]:
    """What a profile keeps of the probes taken while it was measured
    (``calibration.probe``)."""
    return {"seconds": float(statistics.median(samples)), "samples": list(samples),
            "processes": os.cpu_count() or 1, "loop": PROBE_LOOP,
            "what": "median wall time of a fixed plain-Python loop run by one process per core "
                    "at once (epsim.calibrate.probe.core_probe), before every launch of the ranks "
                    "and exchange sweeps and after the last"}


def load_factor(ratio: float, world: int, cores: int) -> float:
    """How much longer ``world`` ranks on ``cores`` cores run when the probe runs ``ratio``
    times as long as at calibration (the module docstring's processor sharing).

    Example: ratio 1.5 on 2 cores (one more busy thread): world 2 -> 1.5, world 4 -> 1.25.
    """
    extra = cores * (ratio - 1.0)
    # a probe far faster than at calibration (ratio near 0) would scale a case to nothing or
    # below, which processor sharing cannot explain: the floor (5 %, an assumption, not a
    # measurement) only keeps the factor positive there
    return max(0.05, 1.0 + extra / max(world, cores))
