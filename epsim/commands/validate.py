"""``epsim validate``: run the runtime over a grid, simulate the same, compare step times.

The work is in ``epsim.calibrate.validate``; this module parses, calls and prints.
"""

from __future__ import annotations

import argparse
import sys
import time

from epsim.calibrate.validate import DEFAULT_GRID, shipped_grids

from ..common import add_json_arg, emit_json
from ..inputs import add_flag


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate", help="check the simulator against the runtime under a (fitted) profile",
        description="Run every configuration of a grid on local runtime ranks, simulate the same "
        "configurations with the profile (sim.step.simulate_step), and report measured against "
        "predicted step times and per-op-kind times.",
    )
    add_flag(p, "--profile", required=True, metavar="PROFILE",
                   help="a profile JSON (epsim calibrate --out) or a shipped hardware name")
    add_flag(p, "--grid", metavar="NAME|FILE", default=DEFAULT_GRID,
                   help="the configurations: a shipped grid (" + ", ".join(shipped_grids())
                   + f") or a JSON list of them (default: the shipped {DEFAULT_GRID!r})")
    add_flag(p, "--steps", command="validate", default=6,
                   help="decode steps per case and pass, the first a warm-up (default 6)")
    add_flag(p, "--repeats", default=3,
                   help="passes over the grid, alternating world sizes (default 3)")
    add_flag(p, "--device", default="cpu", help="default cpu")
    add_flag(p, "--plot", metavar="OUT.png", default=None,
                   help="write a measured-vs-predicted scatter plot (matplotlib)")
    add_json_arg(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from epsim.calibrate.validate import validate

    t0 = time.perf_counter()
    log = None if args.json else (lambda msg: print(f"  ... {msg}", file=sys.stderr))
    report = validate(args.profile, args.grid, steps=args.steps,
                      repeats=args.repeats, device=args.device, plot=args.plot, log=log)
    report["wall_s"] = time.perf_counter() - t0
    if args.json:
        emit_json(report)
        return 0
    print(f"epsim validate: {report['profile']} on {len(report['cases'])} configurations")
    print(f"  {'configuration':<40} {'measured ms':>11} {'predicted ms':>12} {'error':>8}")
    for c in report["cases"]:
        print(f"  {c['label']:<40} {c['measured_ms']:>11.2f} {c['predicted_ms']:>12.2f} "
              f"{c['error_pct']:>+7.1f}%")
    print(f"  |error| median {report['median_abs_error_pct']:.1f}%, p90 "
          f"{report['p90_abs_error_pct']:.1f}%, max {report['max_abs_error_pct']:.1f}%; "
          f"wall {report['wall_s']:.1f} s")
    if args.plot:
        print(f"  plot: {args.plot}")
    return 0
