"""How the serving simulation grows with requests: wall time and peak memory (issue 15).

    python bench/bench_scale.py [--requests 4096,40960] [--rate 40] [--dataset sharegpt-like]

Runs ``epsim predict --model deepseek-r1 --hardware mi300x --dp 8 --ep 8 --dataset DATASET
--num-prompts N --request-rate RATE --json`` once per N, each in its own process (so its peak
resident memory is its own: ``ru_maxrss`` of the child), and prints per run the process's wall
time, its CPU time (user + system: less moved by other jobs on a shared machine), the
simulation's own wall time (``sim_wall_s``), the step simulations it needed, the simulated
benchmark's duration and its peak RSS. Targets of the scale issue: 4,096 requests at 40/s in
<= 2 s; 1,000,000 (``--requests 1000000``) in <= 60 s with peak RSS <= 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(n: int, rate: float, dataset: str) -> dict:
    cmd = [sys.executable, "-m", "epsim", "predict", "--model", "deepseek-r1", "--hardware",
           "mi300x", "--dp", "8", "--ep", "8", "--dataset", dataset, "--num-prompts", str(n),
           "--request-rate", str(rate), "--json"]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu0 = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ))
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_kb, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime - cpu0
    if r.returncode != 0:
        raise SystemExit(f"predict failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    out = json.loads(r.stdout)
    return {"requests": n, "wall_s": wall, "cpu_s": cpu, "sim_wall_s": out.get("sim_wall_s"),
            "step_sim_calls": out.get("step_sim_calls"), "num_steps": out.get("num_steps"),
            "duration_s": out.get("duration"),
            # ru_maxrss of the children is the largest child so far: exact for a run that
            # grows past the ones before it, an upper bound otherwise
            "peak_rss_mb": max(peak_kb, before) / 1024.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="4096,40960", help="comma list of --num-prompts")
    ap.add_argument("--rate", type=float, default=40.0, help="--request-rate (requests/s)")
    ap.add_argument("--dataset", default="sharegpt-like")
    args = ap.parse_args()
    sizes = [int(x) for x in args.requests.split(",")]
    print(f"deepseek-r1 on mi300x, DP8/EP8, {args.dataset}, open loop at {args.rate:g} req/s; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print("| requests | wall s | CPU s | sim_wall s | step sims | steps | simulated s | "
          "peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for n in sorted(sizes):
        f = run(n, args.rate, args.dataset)
        print(f"| {n:,} | {f['wall_s']:.1f} | {f['cpu_s']:.1f} | {f['sim_wall_s']:.1f} | "
              f"{f['step_sim_calls']} | {f['num_steps']:,} | {f['duration_s']:,.0f} | "
              f"{f['peak_rss_mb']:.0f} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
