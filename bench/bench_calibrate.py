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
                    "its timed steps over every pass; default 4)")
    args = ap.parse_args()
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="epsim-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    profile = folder / "cpu-fitted.json"
    r, t_cal = epsim("calibrate", "--out", str(profile), "--json",
                     *(["--quick"] if args.quick else []))
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return r.returncode
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
    print("| configuration | measured ms (p10-p90) | predicted ms | error |")
    print("|---|---|---|---|")
    for c in report["cases"]:
        print(f"| {c['label']} | {c['measured_ms']:.2f} ({c['measured_p10_ms']:.1f}-"
              f"{c['measured_p90_ms']:.1f}) | {c['predicted_ms']:.2f} | {c['error_pct']:+.1f}% |")
    print(f"|error|: median {report['median_abs_error_pct']:.1f}%, p90 "
          f"{report['p90_abs_error_pct']:.1f}%, max {report['max_abs_error_pct']:.1f}% "
          f"(targets: median <= 5%, max <= 15%)")
    print("per op kind (ms summed over the cases; median per-case error):")
    for kind, v in sorted(report["per_kind"].items()):
        err = v["median_error_pct"]
        print(f"  {kind:<18} measured {v['measured_ms_sum']:8.2f}  predicted "
              f"{v['predicted_ms_sum']:8.2f}  median error "
              f"{'n/a' if err is None else f'{err:+.1f}%'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
