"""How fast a search runs: a 1,008-point tune space in steady state on 2 workers, against serial.

Run from the repository root:  python bench/bench_search.py  [--workers 2] [--no-serial]
[--limit N] [--json]

The space (issue 30's): DeepSeek-R1, 2000 in / 100 out, SGLang on NVIDIA and vLLM on AMD (each
hardware's default engine), ``--measure steady``, SLO ``mean_tpot_ms<=100,mean_ttft_ms<=5000``:

    hardware     mi300x, mi325x, h200                         3
    nodes        1, 2                                         2
    split        TP 1, 2, 4 per DP group (DP x EP the rest)   3
    DBO          on, off                                      2
    KV dtype     fp8, bf16                                    2
    concurrency  1, 2, 4, ..., 1024 and 192, 384, 768         14   -> 1,008 points

It runs the space on ``--workers`` processes, then (unless ``--no-serial``) serially in this
process, and prints wall time and points per second of each and whether every point's result
(diagnostics aside) is identical. Beside it, the same machine's aiconfigurator default search
(``aiconfigurator cli default``) when aiconfigurator is installed; it is skipped with a line
when it is not. Target (issue 30): 1,000 points in <= 60 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from typing import Any

from epsim.sim.search.executors import PoolExecutor
from epsim.sim.search.slo import parse_slo
from epsim.sim.search.tune import SearchOptions, SearchSpace, TuneResult, tune
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import WorkloadSpec

SLO = "mean_tpot_ms<=100,mean_ttft_ms<=5000"
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
SPACE = SearchSpace(concurrency=CONCURRENCY, dbo=(True, False), kv_dtype=("fp8", "bf16"),
                    splits=((None, 1), (None, 2), (None, 4)),  # dp: the GPUs over tp
                    hardware=("mi300x", "mi325x", "h200"), nodes=(1, 2))
BASE = Scenario.of(model="deepseek-r1", hardware="mi300x",
                workload=WorkloadSpec(num_prompts=None, isl=2000, osl=100, measure="steady"))
#: aiconfigurator's default search on the same model and GPUs, when it is installed
AIC_COMMAND = ["aiconfigurator", "cli", "default", "--model", "DEEPSEEK_V3", "--total_gpus",
               "8", "--system", "h200_sxm", "--isl", "2000", "--osl", "100"]


def _space(limit: int | None) -> SearchSpace:
    """The space, or its first ``limit`` concurrencies (a quicker run of the same shape)."""
    if limit is None:
        return SPACE
    return SearchSpace(**{**SPACE.__dict__, "concurrency": CONCURRENCY[:limit]})


def _stripped(res: TuneResult) -> Any:
    """What must not depend on where the points ran: every row without its diagnostics."""
    def row(r: dict[str, Any] | None) -> Any:
        return None if r is None else {k: v for k, v in r.items() if k != "diagnostics"}
    return (row(res.best), [row(r) for r in res.points], res.skipped)


def _timed(space: SearchSpace, workers: int) -> tuple[TuneResult, float]:
    slo = parse_slo(SLO)
    t0 = time.perf_counter()
    if workers == 1:
        res = tune(BASE, slo, space, options=SearchOptions(strategy="grid"),
                   check_splits=False)
    else:
        with PoolExecutor(workers=workers) as pool:
            res = tune(BASE, slo, space, check_splits=False,
                       options=SearchOptions(strategy="grid", executor=pool))
    return res, time.perf_counter() - t0


def _aiconfigurator() -> dict[str, Any]:
    """aiconfigurator's default search on this machine, or why it did not run."""
    if shutil.which(AIC_COMMAND[0]) is None:
        return {"skipped": "aiconfigurator is not installed (pip install aiconfigurator)"}
    t0 = time.perf_counter()
    done = subprocess.run(AIC_COMMAND, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"skipped": f"aiconfigurator exited {done.returncode}", "wall_s": wall}
    return {"command": " ".join(AIC_COMMAND), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-serial", action="store_true", help="skip the serial comparison")
    ap.add_argument("--limit", type=int, default=None, help="the first N concurrencies only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    space = _space(args.limit)
    par, wall = _timed(space, args.workers)
    out: dict[str, Any] = {
        "points": space.size(), "ran": len(par.points), "skipped": len(par.skipped),
        "workers": args.workers, "wall_s": round(wall, 2),
        "points_per_s": round(space.size() / wall, 1),
        "best": {k: par.best[k] for k in ("hardware", "concurrency", "dp", "tp", "ep", "dbo",
                                          "kv_dtype", "output_throughput")
                 if par.best and k in par.best} or None}
    if not args.no_serial:
        serial, serial_wall = _timed(space, 1)
        out.update(serial_wall_s=round(serial_wall, 2),
                   serial_points_per_s=round(space.size() / serial_wall, 1),
                   identical_to_serial=_stripped(serial) == _stripped(par))
    out["aiconfigurator"] = _aiconfigurator()
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['points']} points ({out['ran']} ran, {out['skipped']} skipped) on "
          f"{args.workers} workers: {out['wall_s']} s, {out['points_per_s']} points/s")
    if "serial_wall_s" in out:
        print(f"serial: {out['serial_wall_s']} s, {out['serial_points_per_s']} points/s; "
              f"identical to serial: {out['identical_to_serial']}")
    print(f"best: {out['best']}")
    aic = out["aiconfigurator"]
    print("aiconfigurator: " + (aic["skipped"] if "skipped" in aic
                                else f"{aic['wall_s']:.1f} s for its default search"))


if __name__ == "__main__":
    main()
