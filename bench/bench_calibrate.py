"""Calibrate then validate on this machine, as a user would, and print the figures.

    python bench/bench_calibrate.py [--out DIR] [--quick] [--repeats N]

Runs ``epsim calibrate --out DIR/cpu-fitted.json`` and ``epsim validate --profile
DIR/cpu-fitted.json --json --plot DIR/validation.png`` (the default grid,
calibrate/grids/cpu.json), prints each one's wall time, their sum (the acceptance: within 15
minutes on 2 cores), the per-case table and the error statistics, and writes the report to
DIR/validation.json. DIR defaults to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def epsim(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "epsim", *argv], capture_output=True, text=True,
                       cwd=REPO, env=env)
    return r, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for the profile, tables and report")
    ap.add_argument("--quick", action="store_true", help="epsim calibrate --quick")
    ap.add_argument("--repeats", type=int, default=4,
                    help="validate's passes over the grid (each case judged on the median of "
                    "its passes' medians; default 4)")
    args = ap.parse_args()
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="epsim-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    profile = folder / "cpu-fitted.json"
    load0 = os.getloadavg()[0]
    r, t_cal = epsim("calibrate", "--out", str(profile), "--json",
                     *(["--quick"] if args.quick else []))
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return r.returncode
    load1 = os.getloadavg()[0]
    r, t_val = epsim("validate", "--profile", str(profile), "--json", "--repeats",
                     str(args.repeats), "--plot", str(folder / "validation.png"))
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return r.returncode
    report = json.loads(r.stdout)
    (folder / "validation.json").write_text(json.dumps(report, indent=1))
    print(f"machine: {os.cpu_count()} cores; folder {folder}")
    print(f"calibrate wall {t_cal:.1f} s, validate wall {t_val:.1f} s, "
          f"total {t_cal + t_val:.1f} s ({(t_cal + t_val) / 60:.1f} min; acceptance <= 15 min)")
    around = {k: "unknown" if v is None else f"{v:.2f}"
              for k, v in report["load_average"].items()}
    print(f"load average (1 min): before calibrate {load0:.2f}, after it {load1:.2f}, "
          f"around validate {around['before']} -> {around['after']} (its own ranks included)")
    print("| configuration | measured ms: median of passes (pass medians) | spread | "
          "predicted ms | error |")
    print("|---|---|---|---|---|")
    for c in report["cases"]:
        passes = ", ".join(f"{v:.1f}" for v in c["measured_pass_ms"])
        print(f"| {c['label']} | {c['measured_ms']:.2f} ({passes}) | "
              f"{c['pass_spread_pct']:.0f}% | {c['predicted_ms']:.2f} | {c['error_pct']:+.1f}% |")
    print(f"|error|: median {report['median_abs_error_pct']:.1f}%, p90 "
          f"{report['p90_abs_error_pct']:.1f}%, max {report['max_abs_error_pct']:.1f}% "
          f"(targets: median <= 5%, max <= 15%); pass spread median "
          f"{report['median_pass_spread_pct']:.0f}%, max {report['max_pass_spread_pct']:.0f}%")
    print("per op kind (ms summed over the cases; median per-case error):")
    for kind, v in sorted(report["per_kind"].items()):
        err = v["median_error_pct"]
        print(f"  {kind:<18} measured {v['measured_ms_sum']:8.2f}  predicted "
              f"{v['predicted_ms_sum']:8.2f}  median error "
              f"{'n/a' if err is None else f'{err:+.1f}%'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
