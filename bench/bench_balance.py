"""Benchmark of epsim's expert balancer on the shared DeepSeek-V3 load files.

Prints (as markdown, the figures in docs/placement.md):
  1. wall time to balance all 58 MoE layers on 8 GPUs (median of --repeats runs), per method;
  2. imbalance (max GPU load / mean GPU load, mean and worst over layers) fitted on each file
     and held out on the other file of the same phase: contiguous, greedy, kk-swap, epsim,
     the lower bound;
  3. what helps held out: redundant slots, fitting on a mixture, online rebalancing.

Usage: python bench/bench_balance.py [--loads-dir DIR] [--repeats N] [--skip-online]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rebalance_study import (  # noqa: E402
    RebalancePolicy,
    expert_weight_bytes,
    load_stream,
    simulate_rebalancing,
)

from epsim.model import load_model  # noqa: E402
from epsim.model.eplb import DEFAULT_METHOD, balance_placement, moved_experts  # noqa: E402
from epsim.model.eplb.balance import lower_bound  # noqa: E402
from epsim.model.loads import frequencies, read_loads, shipped_loads  # noqa: E402
from epsim.model.placement import contiguous_placement  # noqa: E402
from epsim.sim.hardware.profile import load_profile  # noqa: E402

PAIRS = {"decode_in1000out1000": "decode_in2000out100", "decode_in2000out100":
         "decode_in1000out1000", "prefill_in2048": "prefill_in4096",
         "prefill_in4096": "prefill_in2048"}
GPUS = 8


def summary(imb: np.ndarray) -> str:
    digits = 7 if imb.max() < 1.001 else 5
    return f"{imb.mean():.{digits}f} / {imb.max():.{digits}f}"


def moe(placement, loads) -> np.ndarray:
    return placement.imbalance(loads)[loads.sum(axis=1) > 0]


def timing(files: dict[str, np.ndarray], repeats: int) -> None:
    print("## Time to balance 58 layers x 256 experts on 8 GPUs: median wall ms / median CPU ms "
          "of this process\n")
    cases = [("greedy", {}), ("kk-swap", {}), (DEFAULT_METHOD, {}), ("greedy-swap2", {}),
             (DEFAULT_METHOD, {"redundant": 32}), (DEFAULT_METHOD, {"nodes": 2}),
             ]
    print("| method | " + " | ".join(files) + " |")
    print("|---|" + "---|" * len(files))
    for method, kw in cases:
        row = []
        for loads in files.values():
            balance_placement(loads, GPUS, method, **kw)  # warm caches
            times, cpu = [], []
            for _ in range(repeats):
                t, c = time.perf_counter(), time.process_time()
                balance_placement(loads, GPUS, method, **kw)
                times.append((time.perf_counter() - t) * 1e3)
                cpu.append((time.process_time() - c) * 1e3)
            row.append(f"{statistics.median(times):.1f} / {statistics.median(cpu):.1f}")
        label = method + "".join(f" {k}={v}" for k, v in kw.items())
        print(f"| {label} | " + " | ".join(row) + " |")
    print()


def quality(files: dict[str, np.ndarray]) -> None:
    print("## Imbalance, mean / worst over the 58 MoE layers (8 GPUs, no replicas)\n")
    print("| fitted on | contiguous | greedy | kk-swap | epsim | greedy-swap2 | lower bound "
          "| held out on | contiguous | greedy | kk-swap | epsim | greedy-swap2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    held = {"greedy": [], "kk-swap": [], DEFAULT_METHOD: [], "greedy-swap2": []}
    for name, loads in files.items():
        other = files[PAIRS[name]]
        cont = contiguous_placement(*loads.shape, GPUS)
        fits = {m: balance_placement(loads, GPUS, m) for m in held}
        lb = lower_bound(loads, GPUS)
        cells = [summary(moe(cont, loads))] + [summary(moe(p, loads)) for p in fits.values()]
        cells.append(f"{lb['mean']:.7f} / {lb['max']:.7f}")
        cells.append(PAIRS[name])
        cells.append(summary(moe(cont, other)))
        for m, p in fits.items():
            imb = moe(p, other)
            held[m].append(imb.mean())
            cells.append(summary(imb))
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nHeld out, mean over the four pairs: "
          + ", ".join(f"{m} {np.mean(v):.5f}" for m, v in held.items()) + "\n")


def held_out_helpers(files: dict[str, np.ndarray]) -> None:
    print("## What helps held out (mean imbalance over layers; fitted -> measured)\n")
    print("| fitted on | measured on | epsim R=0 | R=16 | R=32 (36/GPU) | R=64 | "
          "fit on mixture of both | mixture R=32 |")
    print("|---|---|---|---|---|---|---|---|")
    for phase in ("decode", "prefill"):
        names = [n for n in files if n.startswith(phase)]
        mix = sum(frequencies(files[n]) for n in names) / len(names)
        mixed = {r: balance_placement(mix, GPUS, redundant=r) for r in (0, 32)}
        for fit in names:
            other = files[PAIRS[fit]]
            cells = [f"{moe(balance_placement(files[fit], GPUS, redundant=r), other).mean():.5f}"
                     for r in (0, 16, 32, 64)]
            cells += [f"{moe(mixed[r], other).mean():.5f}" for r in (0, 32)]
            print(f"| {fit} | {PAIRS[fit]} | " + " | ".join(cells) + " |")
    print("\nFitted with R=32 (36 slots per GPU), mean / worst: " + ", ".join(
        f"{n} {summary(moe(balance_placement(files[n], GPUS, redundant=32), files[n]))}"
        for n in files))
    # a truly held-out mixture: fitted on one phase's mixture, measured on the other phase
    dec = sum(frequencies(files[n]) for n in files if n.startswith("decode")) / 2
    pre = sum(frequencies(files[n]) for n in files if n.startswith("prefill")) / 2
    for fit_name, fit, meas in (("decode mixture", dec, "prefill"),
                                ("prefill mixture", pre, "decode")):
        for r in (0, 32):
            p = balance_placement(fit, GPUS, redundant=r)
            vals = [moe(p, files[n]).mean() for n in files if n.startswith(meas)]
            print(f"\nCross phase: {fit_name}, R={r}, measured on the {meas} files: "
                  + ", ".join(f"{v:.5f}" for v in vals), end="")
    print("\n")


def moves(files: dict[str, np.ndarray]) -> None:
    print("## Re-placing for new loads: imbalance vs experts moved\n")
    print("Placement in use fitted on the first file; new loads = the second. Moved = expert "
          "copies (GPU, expert pairs new to the placement), total over 58 layers and worst "
          "layer.\n")
    print("| in use -> new loads | mode | imbalance on new loads | moved total | moved worst "
          "layer |")
    print("|---|---|---|---|---|")
    for old_name, new_name in (("decode_in2000out100", "decode_in1000out1000"),
                               ("prefill_in2048", "prefill_in4096")):
        old_loads, new_loads = files[old_name], files[new_name]
        old = balance_placement(old_loads, GPUS)
        cases = [("keep", old), ("fresh fit, GPUs not matched", balance_placement(new_loads, GPUS)),
                 ("fresh fit, GPUs matched", balance_placement(new_loads, GPUS, previous=old))]
        for k in (4, 8, 16, 32, 64):
            cases.append((f"max_moves {k}", balance_placement(new_loads, GPUS, previous=old,
                                                              max_moves=k)))
        for label, p in cases:
            moved = moved_experts(old, p)
            imb = moe(p, new_loads)
            print(f"| {old_name} -> {new_name} | {label} | {imb.mean():.6f} / {imb.max():.6f} "
                  f"| {int(moved.sum())} | {int(moved.max())} |")
    print()


def online(files: dict[str, np.ndarray]) -> None:
    print("## Online rebalancing (simulated steps; decode, 512 tokens per GPU, top-8)\n")
    a, b = files["decode_in2000out100"], files["decode_in1000out1000"]
    profile = load_profile("mi300x")
    expert_bytes = expert_weight_bytes(load_model("deepseek-r1"))
    phases = [(a, 200), (b, 400), (a, 400)]
    assignments = 512 * GPUS * 8
    print("Stream: 200 steps of decode_in2000out100, 400 of decode_in1000out1000, 400 of "
          "decode_in2000out100; static = fitted on decode_in2000out100 once.\n")
    print("| policy | static mean | online mean | rebalances | experts moved | "
          "GB moved | move s total | move s max (one step) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, redundant, policy in [
        ("every 100 steps, window 100", 0, RebalancePolicy(100, 100)),
        ("every 100, window 100, min_gain 0.01", 0, RebalancePolicy(100, 100, min_gain=0.01)),
        ("every 100, window 100, max 16 moves/layer, min_gain 0.01", 0,
         RebalancePolicy(100, 100, max_moves=16, min_gain=0.01)),
        ("every 100, window 400, max 16 moves/layer, min_gain 0.01", 0,
         RebalancePolicy(100, 400, max_moves=16, min_gain=0.01)),
        ("R=32, every 100, window 100, max 16, min_gain 0.01", 32,
         RebalancePolicy(100, 100, redundant=32, max_moves=16, min_gain=0.01)),
    ]:
        initial = balance_placement(a, GPUS, redundant=redundant)
        run = simulate_rebalancing(load_stream(phases, assignments, seed=7), initial, policy,
                                   expert_bytes, profile)
        s = run.summary()
        print(f"| {label} | {s['static_imbalance_mean']:.4f} | {s['online_imbalance_mean']:.4f} "
              f"| {s['rebalances']} | {s['moved_experts']} | {s['moved_bytes'] / 1e9:.1f} "
              f"| {s['move_seconds_total']:.3f} | {s['move_seconds_max']:.4f} |")
        blocks = run.online_imbalance.reshape(-1, 100).mean(axis=1)
        static = run.static_imbalance.reshape(-1, 100).mean(axis=1)
        print("|   per 100 steps (static) | " + " ".join(f"{x:.3f}" for x in static)
              + " |||||||")
        print("|   per 100 steps (online) | " + " ".join(f"{x:.3f}" for x in blocks)
              + " |||||||")
    print()


def online_simulated(files: dict[str, np.ndarray]) -> None:
    from rebalance_study import simulate_online_eplb

    from epsim.model import make_plan
    from epsim.model.opgraph import Batch

    print("## Online rebalancing through the step simulator (sim.step.simulate.simulate_step)\n")
    model = load_model("deepseek-r1")
    plan = make_plan(model, dp=8, ep=8)
    profile = load_profile("mi300x")
    print("DeepSeek-R1, DP8/EP8 on 8x MI300X; every 20 steps, window 20, max 16 moves/layer, "
          "min_gain 0.01; the static placement is fitted on the first phase's file.\n")
    print("| batch per GPU | phases (steps) | static step ms | online step ms (moves "
          "included) | worst online step ms | rebalances | experts copied | move s total |")
    print("|---|---|---|---|---|---|---|---|")
    policy = RebalancePolicy(20, 20, max_moves=16, min_gain=0.01)
    for label, batch, first, second in (
        ("decode 512 seqs, context 2100", Batch.decode(512, 2100), "decode_in2000out100",
         "decode_in1000out1000"),
        ("prefill 2 x 4096 tokens", Batch.prefill(2, 4096), "prefill_in2048", "prefill_in4096"),
        ("prefill 2 x 4096 tokens", Batch.prefill(2, 4096), "prefill_in2048",
         "decode_in1000out1000"),
    ):
        phases = [(files[first], 20), (files[second], 60), (files[first], 60)]
        run = simulate_online_eplb(model, plan, batch, profile, phases, policy)
        s = run.summary()
        print(f"| {label} | {first} 20, {second} 60, {first} 60 | {s['static_step_ms_mean']:.2f} "
              f"| {s['online_step_ms_mean']:.2f} | {s['online_step_ms_max']:.2f} "
              f"| {s['rebalances']} | {s['moved_experts']} | {s['move_seconds_total']:.3f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads-dir", default=None,
                        help="a folder of the four load files (default: the shipped ones)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-online", action="store_true")
    args = parser.parse_args()
    if args.loads_dir:
        files = {p.stem: read_loads(p) for p in sorted(Path(args.loads_dir).glob("*.json"))}
    else:
        files = {name: read_loads(name) for name in shipped_loads()}
    if set(files) != set(PAIRS):
        sys.exit(f"expected the four load files {sorted(PAIRS)}, got {sorted(files)}")
    timing(files, args.repeats)
    quality(files)
    held_out_helpers(files)
    moves(files)
    if not args.skip_online:
        online(files)
        online_simulated(files)


if __name__ == "__main__":
    main()
