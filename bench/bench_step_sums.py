"""How far the per-op medians of a decode step on shared cores sum short of the step itself.

    python bench/bench_step_sums.py [--worlds 2 4] [--steps 12]

Launches the calibration shapes (``epsim.calibrate.micro.CALIBRATION_SHAPES`` at the ranks
sweep's batch and context points) on W local ranks as ``epsim run`` does, with per-op tracing,
and prints per configuration, for the compute ops and for the exchanges (dispatch, combine)
apart, three sums over a rank's timed steps (averaged over the ranks):

- the sum over ops of each op's median time;
- the sum over ops of each op's mean time;
- the median over steps of the step's own sum;

and the slowest rank's median step (its wall time: what ``epsim validate`` measures) beside the
mean rank's summed ops (compute and exchanges, medians over steps).

A step is a sum of ops, so its median follows the sum of the means; ranks time-sliced on shared
cores are preempted in a few long samples, which the medians drop. The ranks sweep keeps both
statistics (``time_s``, ``mean_s``) and calibrate fits a step's shares from the means
(``epsim.calibrate.fit.step_share_s``); docs/validation.md has this machine's figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from epsim.calibrate import micro
from epsim.runtime import RunOptions, launch_local

EXCHANGES = ("dispatch", "combine")


def sums(summary: dict, world: int) -> dict[str, tuple[float, float, float]]:
    """``{"compute"|"exchange": (sum of medians, sum of means, median step sum)}`` in ms, per
    rank (averaged over the ranks)."""
    per_op: dict[tuple, list[float]] = {}
    per_step: dict[tuple, float] = {}
    for e in summary["trace_events"]:
        step = e.args.get("step", 0)
        if step < 1:  # warm-up
            continue
        part = "exchange" if e.kind in EXCHANGES else "compute"
        per_op.setdefault((part, e.op_id, e.rank), []).append(e.dur_us / 1e3)
        per_step[(part, step, e.rank)] = per_step.get((part, step, e.rank), 0.0) + e.dur_us / 1e3
    steps = sorted({s for _, s, _ in per_step})
    out: dict[str, tuple[float, ...]] = {}
    for part in ("compute", "exchange"):
        ops = [v for k, v in per_op.items() if k[0] == part]
        step_sums = [statistics.fmean(per_step.get((part, s, r), 0.0) for r in range(world))
                     for s in steps]
        out[part] = (sum(statistics.median(v) for v in ops) / world,
                     sum(statistics.fmean(v) for v in ops) / world, statistics.median(step_sums))
    both = [statistics.fmean(per_step.get((p, s, r), 0.0) for p in ("compute", "exchange")
                             for r in range(world)) * 2 for s in steps]
    slowest = [max(rank[s] for rank in summary["step_ms_per_rank"]) for s in steps]
    out["wall"] = (statistics.median(both), statistics.median(slowest))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=12, help="decode steps per configuration, "
                    "the first a warm-up (default 12)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="epsim-step-sums-"))
    for world in args.worlds:
        options, labels = [], []
        for shape in micro.CALIBRATION_SHAPES:
            path = micro.write_shape_config(shape, folder)
            for batch, context in micro.RANKS_POINTS:
                options.append(RunOptions(model=str(path), world_size=world, batch=batch,
                                          context=context, steps=args.steps, trace=True))
                labels.append(f"{shape.name} b{batch} c{context}")
        total = {p: [0.0, 0.0, 0.0] for p in ("compute", "exchange")}
        walls = []
        print(f"world {world}: ms per rank and step (sum of op medians / of op means / "
              "median step sum; then the mean rank's summed ops against the slowest rank's "
              "step, medians)")
        for label, summary in zip(labels, launch_local(options, world), strict=True):
            got = sums(summary, world)
            ops_ms, slowest_ms = got.pop("wall")
            walls.append(slowest_ms - ops_ms)
            cells = []
            for part, (med, mean, step) in got.items():
                cells.append(f"{part} {med:6.2f} / {mean:6.2f} / {step:6.2f}")
                total[part] = [a + b for a, b in zip(total[part], (med, mean, step),
                                                     strict=True)]
            print(f"  {label:<22} " + "  ".join(cells)
                  + f"  ops {ops_ms:6.2f} / slowest {slowest_ms:6.2f}")
        print(f"  the slowest rank's step ran {min(walls):.1f}-{max(walls):.1f} ms past the mean "
              "rank's summed ops")
        for part, (med, mean, step) in total.items():
            print(f"  all {part:<8}: medians {med:7.1f}, means {mean:7.1f}, steps {step:7.1f} "
                  f"ms: the medians sum {100 * (1 - med / step):.0f} % short of the steps, "
                  f"the means {100 * (mean / step - 1):+.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
