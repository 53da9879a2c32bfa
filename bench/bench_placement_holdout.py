"""Held-out imbalance of expert placements: epsim's balancers beside DeepSeek's EPLB.

A placement is fitted to one or more load files and measured on a file it was not fitted to
(imbalance = max GPU load / mean GPU load per MoE layer; mean and worst over the layers).
Protocol, on the shipped DeepSeek-V3 files (model/data/loads/) unless --loads names others:
  * fit on one file, measure on each other file (all ordered pairs);
  * fit on two files, measure on each of the others (every pair, every remaining file);
  * fit on three, measure on the fourth;
  * and, for one file of one's own, what else was tried: smoothing toward uniform, synthetic
    snapshots, the spread over near-optimal partitions, a second file as a prior.
"Fitted" is the imbalance on the fit files themselves (each layer's worst fit file). Several
fit files are several snapshots: ``minmax`` fits the worst of them, every other method (and
DeepSeek's EPLB, which takes one load matrix) fits their mean, each file scaled to the same
total per layer (epsim.model.eplb.snapshots.snapshot_weights).

DeepSeek's EPLB is imported from the path given (``--deepseek-eplb PATH/eplb.py``, from
https://github.com/deepseek-ai/EPLB; it needs torch) and never copied into this repository. It
runs as SGLang calls it for one node: ``rebalance_experts(weight, experts + R, num_groups=8,
num_nodes=1, num_gpus=G)``; its ``physical_to_logical`` map is read as an epsim Placement (the
same layout: GPU g holds slots g*S .. g*S+S-1). Without the flag its columns are left out.

Usage:
  python bench/bench_placement_holdout.py [--deepseek-eplb PATH/eplb.py] [--redundant 0,32]
      [--gpus 8] [--repeats 5] [--loads NAME,NAME,...] [--methods greedy,greedy-swap,minmax]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from epsim.model.eplb import balance_placement
from epsim.model.eplb.snapshots import snapshot_weights
from epsim.model.loads import moe_layer_rows, read_loads, shipped_loads
from epsim.model.placement import Placement

#: the model's routing groups (DeepSeek-V3 config.json n_group), as SGLang passes them
NUM_GROUPS = 8

Fitter = Callable[[np.ndarray], Placement]  # [S, layers, E] loads -> placement


def load_deepseek(path: str) -> Callable:
    """``rebalance_experts`` from DeepSeek's eplb.py at ``path`` (imported by path)."""
    spec = importlib.util.spec_from_file_location("deepseek_eplb", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rebalance_experts


def deepseek_fitter(rebalance: Callable, gpus: int, redundant: int) -> Fitter:
    import torch

    def fit(snapshots: np.ndarray) -> Placement:
        weight = torch.from_numpy(snapshot_weights(snapshots).mean(axis=0))
        phy2log, _, _ = rebalance(weight, weight.shape[1] + redundant, NUM_GROUPS, 1, gpus)
        return Placement(phy2log.numpy(), num_gpus=gpus, num_logical=weight.shape[1])
    return fit


def epsim_fitter(method: str, gpus: int, redundant: int) -> Fitter:
    def fit(snapshots: np.ndarray) -> Placement:
        loads = snapshots[0] if len(snapshots) == 1 else snapshots
        return balance_placement(loads, gpus, method, redundant=redundant)
    return fit


def imbalance(placement: Placement, loads: np.ndarray) -> np.ndarray:
    return placement.imbalance(loads)


def cases(names: list[str]) -> list[tuple[tuple[str, ...], str]]:
    """(fit files, held-out file): one, two and three fit files."""
    out = []
    for size in (1, 2, 3):
        for fit in itertools.combinations(names, size):
            out += [(fit, held) for held in names if held not in fit]
    return out


def run_cases(fitters: dict[str, Fitter], files: dict[str, np.ndarray]
              ) -> dict[tuple[tuple[str, ...], str], dict[str, tuple[float, float, float]]]:
    """Per case and method: (fitted mean, held-out mean, held-out worst layer)."""
    results: dict = {}
    placements: dict = {}
    for fit, held in cases(list(files)):
        row = {}
        for name, fitter in fitters.items():
            key = (name, fit)
            if key not in placements:
                placements[key] = fitter(np.stack([files[f] for f in fit]))
            p = placements[key]
            fitted = np.max([imbalance(p, files[f]) for f in fit], axis=0)
            out = imbalance(p, files[held])
            row[name] = (float(fitted.mean()), float(out.mean()), float(out.max()))
        results[(fit, held)] = row
    return results


def short(name: str) -> str:
    return (name.replace("decode_in", "d").replace("prefill_in", "p")
            .replace("out", "/"))


def print_cases(results: dict, methods: list[str], redundant: int) -> None:
    print(f"\n### Per case, R={redundant}: fitted mean | held-out mean / worst layer\n")
    print("| fitted on | held out on | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for (fit, held), row in results.items():
        cells = [f"{row[m][0]:.5f} \\| **{row[m][1]:.5f}** / {row[m][2]:.4f}" for m in methods]
        print(f"| {' + '.join(short(f) for f in fit)} | {short(held)} | " + " | ".join(cells)
              + " |")


def print_summary(results: dict, methods: list[str], redundant: int) -> None:
    print(f"\n### Mean over the cases, R={redundant}: fitted | held out\n")
    print("| fit files | cases | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for size in (1, 2, 3):
        rows = [row for (fit, _), row in results.items() if len(fit) == size]
        if not rows:
            continue
        cells = []
        for m in methods:
            fitted = statistics.fmean(r[m][0] for r in rows)
            held = statistics.fmean(r[m][1] for r in rows)
            cells.append(f"{fitted:.5f} \\| **{held:.5f}**")
        print(f"| {size} | {len(rows)} | " + " | ".join(cells) + " |")


def _interleaved(fitters: dict[str, Fitter], stack: np.ndarray, repeats: int
                 ) -> dict[str, list[tuple[float, float]]]:
    """``repeats`` rounds, each calling every fitter once in turn (so a loaded machine slows
    all of them alike): per fitter, (wall ms, CPU ms of this process) of each round."""
    for fitter in fitters.values():
        fitter(stack)  # warm caches
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in fitters}
    for _ in range(repeats):
        for name, fitter in fitters.items():
            t, c = time.perf_counter(), time.process_time()
            fitter(stack)
            out[name].append(((time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3))
    return out


def print_times(fitters: dict[str, Fitter], files: dict[str, np.ndarray], repeats: int,
                redundant: int) -> None:
    names = list(files)
    sets = [(n,) for n in names] + [names[:2]]
    ref = "DeepSeek EPLB" if "DeepSeek EPLB" in fitters else None
    print(f"\n### Time to fit all {len(next(iter(files.values())))} MoE layers, R={redundant}: "
          f"median of {repeats} interleaved rounds, wall ms / CPU ms of this process"
          + (f"; x: {ref}'s time over the method's in the same round (median, wall / CPU)"
             if ref else "") + f"; load average {os.getloadavg()[0]:.1f}\n")
    print("| method | " + " | ".join(" + ".join(short(f) for f in s) for s in sets) + " |")
    print("|---|" + "---|" * len(sets))
    runs = [_interleaved(fitters, np.stack([files[f] for f in fit]), repeats) for fit in sets]
    for name in fitters:
        cells = []
        for run in runs:
            wall = statistics.median(w for w, _ in run[name])
            cpu = statistics.median(c for _, c in run[name])
            cell = f"{wall:.1f} / {cpu:.1f}"
            if ref and name != ref:
                rw = statistics.median(d[0] / m[0] for m, d in zip(run[name], run[ref], strict=True))
                rc = statistics.median(d[1] / max(m[1], 1e-9)
                                       for m, d in zip(run[name], run[ref], strict=True))
                cell += f" (x{rw:.1f} / x{rc:.1f})"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")


def _pairs(files: dict[str, np.ndarray]) -> list[tuple[str, str]]:
    return [(a, b) for a in files for b in files if a != b]


def _one_file_rows(files: dict[str, np.ndarray], gpus: int, redundant: int
                   ) -> list[tuple[str, float, float]]:
    """(idea, mean fitted on the own file, mean held out) over every ordered pair of files."""
    rng = np.random.default_rng(0)
    e = next(iter(files.values())).shape[1]

    def over_pairs(fit: Callable[[str, str], Placement]) -> tuple[float, float]:
        fitted, held = [], []
        for a, b in _pairs(files):
            p = fit(a, b)
            fitted.append(p.imbalance(files[a]).mean())
            held.append(p.imbalance(files[b]).mean())
        return statistics.fmean(fitted), statistics.fmean(held)

    def place(loads: np.ndarray, method: str | None = None) -> Placement:
        return balance_placement(loads, gpus, method, redundant=redundant)

    def smooth(loads: np.ndarray, alpha: float) -> np.ndarray:
        freq = loads / loads.sum(axis=1, keepdims=True)
        return (1 - alpha) * freq + alpha / e

    def synthetic(loads: np.ndarray, k: int, sigma: float) -> np.ndarray:
        return np.stack([loads] + [loads * np.exp(sigma * rng.standard_normal(loads.shape))
                                   for _ in range(k)])

    rows = [("greedy-swap on the file (the default)", *over_pairs(lambda a, b: place(files[a])))]
    for alpha in (0.25, 0.5):
        rows.append((f"smoothed toward uniform, alpha {alpha}",
                     *over_pairs(lambda a, b, al=alpha: place(smooth(files[a], al)))))
    for k, sigma in ((2, 0.1), (2, 0.3), (4, 0.3)):
        rows.append((f"minmax on the file + {k} synthetic snapshots (x lognormal, sigma {sigma})",
                     *over_pairs(lambda a, b, k=k, s=sigma: place(synthetic(files[a], k, s),
                                                                   "minmax"))))
    # how much the choice among near-optimal partitions matters: 20 fits of slightly perturbed
    # loads (1e-3 relative), each measured held out
    spread = []
    for _ in range(20):
        noise = {n: x * (1 + 1e-3 * rng.standard_normal(x.shape)) for n, x in files.items()}
        spread.append(over_pairs(lambda a, b, nz=noise: place(nz[a])))
    held = [h for _, h in spread]
    rows.append((f"20 near-optimal partitions (perturbed 1e-3): held out sd "
                 f"{statistics.stdev(held):.5f}, min {min(held):.5f}, max {max(held):.5f}",
                 statistics.fmean(f for f, _ in spread), statistics.fmean(held)))
    # a second snapshot from another workload (a shipped file as a prior); the held-out file
    # is never among the fit files
    def with_prior(a: str, b: str) -> Placement:
        prior = [c for c in files if c not in (a, b)]
        return place(np.stack([files[a], files[prior[0]]]), "minmax")

    if len(files) >= 3:
        rows.append(("minmax on the file + the first other file (neither held out)",
                     *over_pairs(with_prior)))
    return rows


def print_one_file(files: dict[str, np.ndarray], gpus: int, redundant: int) -> None:
    print(f"\n### One load file of one's own, R={redundant}: what else was tried (mean over "
          f"the {len(_pairs(files))} ordered pairs; fitted on the own file | held out)\n")
    print("| idea | fitted | held out |")
    print("|---|---|---|")
    for idea, fitted, held in _one_file_rows(files, gpus, redundant):
        print(f"| {idea} | {fitted:.5f} | **{held:.5f}** |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepseek-eplb", metavar="PATH/eplb.py",
                    help="DeepSeek's eplb.py (github.com/deepseek-ai/EPLB); needs torch")
    ap.add_argument("--loads", default=",".join(shipped_loads()),
                    help="comma list of load files or shipped names (default: the shipped ones)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--redundant", default="0,32", help="comma list of redundant slot counts")
    ap.add_argument("--methods", default="greedy,greedy-swap,minmax",
                    help="epsim balancers to run")
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats (0: no timing)")
    ap.add_argument("--no-ideas", action="store_true",
                    help="skip the table of one-file ideas (smoothing, synthetic snapshots, ...)")
    args = ap.parse_args()

    names = args.loads.split(",")
    raw = {Path(n).stem: read_loads(n) for n in names}
    rows = moe_layer_rows(next(iter(raw.values())))
    files = {n: loads[rows] for n, loads in raw.items()}
    rebalance = load_deepseek(args.deepseek_eplb) if args.deepseek_eplb else None
    if rebalance is not None:
        import torch

        print(f"DeepSeek EPLB: {Path(args.deepseek_eplb).resolve()}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
    experts = next(iter(files.values())).shape[1]
    print(f"{args.gpus} GPUs, {len(rows)} MoE layers x {experts} experts; "
          f"files: {', '.join(f'{short(n)} = {n}' for n in files)}")
    for redundant in (int(r) for r in args.redundant.split(",")):
        fitters = {m: epsim_fitter(m, args.gpus, redundant) for m in args.methods.split(",")}
        if rebalance is not None:
            fitters["DeepSeek EPLB"] = deepseek_fitter(rebalance, args.gpus, redundant)
        results = run_cases(fitters, files)
        print_summary(results, list(fitters), redundant)
        print_cases(results, list(fitters), redundant)
        if not args.no_ideas:
            print_one_file(files, args.gpus, redundant)
        if args.repeats:
            print_times(fitters, files, args.repeats, redundant)


if __name__ == "__main__":
    main()
