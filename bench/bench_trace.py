"""A real profiler trace against the simulator: ``epsim calibrate --from-trace`` as a table.

Prints (as markdown, the figures in docs/validation.md):
  1. the share of the GPU kernel time under the trace's forward annotations that the kernel-name
     table maps to op kinds, and the names it does not map, with their time;
  2. per op kind the kernel families behind the measured time;
  3. per op kind measured beside the simulator's for the same deployment (from the trace's
     metadata: world size, device, seqlen; the layers its annotations cover), under the
     profile's default kernel set and under the roofline alone.

Usage: python bench/bench_trace.py --trace PATH [--model deepseek-v3] [--annotations NAMES]
(PATH: e.g. ../shared/data/traces/deepseek-v3-train-h800-ep64.json, DeepSeek's published
profile of DeepSeek-V3 training chunks on H800 at EP64.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def calibrate(trace: str, model: str, annotations: str | None, kernels: str | None) -> dict:
    """``epsim calibrate --from-trace`` as a user runs it (one JSON object)."""
    cmd = [sys.executable, "-m", "epsim", "calibrate", "--from-trace", trace, "--model", model,
           "--json"]
    if annotations:
        cmd += ["--annotations", annotations]
    if kernels:
        cmd += ["--kernels", kernels]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(done.stderr.strip() or f"epsim calibrate exited {done.returncode}")
    return json.loads(done.stdout)


def _ratio(row: dict) -> str:
    return f"{row['ratio']:.2f}" if row.get("ratio") is not None else "-"


def report(default: dict, roofline: dict) -> None:
    meta, dep = default["metadata"], default["deployment"]
    print(f"## {meta.get('trace_name', default['trace'])} ({meta.get('device', '?')}, rank "
          f"{meta.get('rank', '?')} of {meta.get('world_size', '?')})\n")
    print(f"Scope: kernels launched under {', '.join(default['scope']['annotations'])} "
          f"({default['scope']['layers']} layers); {default['kernels']} kernels, "
          f"{default['kernel_us'] / 1e3:.2f} ms.\n")
    print(f"**mapped_fraction {default['mapped_fraction']:.4f}** "
          f"({default['mapped_us'] / 1e3:.2f} of {default['kernel_us'] / 1e3:.2f} ms)\n")
    print("| unmapped kernel | count | us |\n|---|---:|---:|")
    for item in default["unmapped"]:
        print(f"| `{item['name']}` | {item['count']} | {item['us']:.0f} |")
    print("\n| op kind | kernel families (us) |\n|---|---|")
    for kind, row in default["kinds"].items():
        fams = ", ".join(f"{f} {us:.0f}" for f, us in row["families"].items())
        print(f"| {kind} | {fams} |")
    print(f"\nSimulated: {dep['model']} on {dep['hardware']}, dp {dep['dp']} ep {dep['ep']} tp "
          f"{dep['tp']} ({dep['nodes']} nodes), {dep['batch']} x {dep['context']} tokens per "
          f"rank, one prefill microbatch, uniform routing, {dep['kv_dtype']} attention, "
          f"{dep['layers']} MoE layers of rank {dep['rank']}.\n")
    print(f"| op kind | measured us | simulated us ({dep['kernels'] or 'default set'}) | "
          "measured / simulated | simulated us (roofline) | measured / roofline |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, row in default["comparison"].items():
        roof = roofline["comparison"].get(kind, {"simulated_us": 0.0, "ratio": None})
        print(f"| {kind} | {row['measured_us']:.0f} | {row['simulated_us']:.0f} | "
              f"{_ratio(row)} | {roof['simulated_us']:.0f} | {_ratio(roof)} |")
    total_m = sum(r["measured_us"] for r in default["comparison"].values())
    total_s = sum(r["simulated_us"] for r in default["comparison"].values())
    print(f"| **all** | {total_m:.0f} | {total_s:.0f} | {total_m / total_s:.2f} | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="a Kineto Chrome trace JSON")
    ap.add_argument("--model", default="deepseek-v3", help="the traced model (default "
                    "deepseek-v3)")
    ap.add_argument("--annotations", default=None, help="as calibrate --annotations")
    args = ap.parse_args()
    report(calibrate(args.trace, args.model, args.annotations, None),
           calibrate(args.trace, args.model, args.annotations, "none"))


if __name__ == "__main__":
    main()
