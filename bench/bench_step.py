"""Speed of the step simulator on the acceptance scenario (issues 3 and 15).

One DeepSeek-R1 decode step on 8x MI300X, DP8/EP8, 512 sequences per rank, context 2100, DBO on,
graph mode, synthetic skewed loads. Targets: a cold shape (a batch not seen before, on a plan
whose step structure is compiled) <= 10 ms, a warm call (a new routing sample of a compiled
batch) <= 2 ms, exact mode <= 1 s, fast and exact equal.

    python bench/bench_step.py [--repeat N]

Prints the wall time of: the process's first call (builds the op graph and its structure, and
loads numba's compiled walk from its cache: once per process); cold shapes (new contexts on the
compiled structure, each with a new seed: one layer per class rebuilt and costed,
``sim/step/compile.py``, and a new routing sample); new contexts of a batch and seed already
met, as the serving simulator's grid points are (one seed per run: the sample and the routed
ops' times are memoised, ``sim/step/routed.py``); warm fast calls (a new routing sample of a
compiled batch); exact calls; and the step times each mode gives.
"""

from __future__ import annotations

import argparse
import statistics
import time

from epsim.model import Batch, load_model, make_plan  # noqa: E402
from epsim.sim.hardware.profile import load_profile  # noqa: E402
from epsim.sim.step import StepMemo, simulate_step  # noqa: E402

#: first seed of the cold-shape calls and of the warm ones (apart, so no call reuses a sample)
COLD_SEEDS = 1000
WARM_SEEDS = 2000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    model = load_model("deepseek-r1")
    profile = load_profile("mi300x")
    plan = make_plan(model, dp=8, ep=8)  # DBO and graph mode on by default
    batch = Batch.decode(512, 2100)
    memo = StepMemo()  # every call below shares it, as a serving run's step models do

    t = time.perf_counter()
    cold = simulate_step(model, plan, batch, profile, seed=0, memo=memo)
    cold_s = time.perf_counter() - t

    # the cold and warm calls draw from seeds no earlier call used (a sample is memoised per
    # batch and seed); the serving loop's case reuses seed 0's sample on purpose, and the exact
    # calls the warm ones' seeds (to compare the two modes on the same samples)
    cold_times = []
    for i in range(args.repeat):
        t = time.perf_counter()
        simulate_step(model, plan, Batch.decode(512, 2101 + i), profile, seed=COLD_SEEDS + i,
                      memo=memo)
        cold_times.append(time.perf_counter() - t)

    serving_times = []
    for i in range(args.repeat):
        t = time.perf_counter()
        simulate_step(model, plan, Batch.decode(512, 4101 + i), profile, seed=0, memo=memo)
        serving_times.append(time.perf_counter() - t)

    fast_times, fast_steps = [], []
    for seed in range(WARM_SEEDS, WARM_SEEDS + args.repeat):
        t = time.perf_counter()
        r = simulate_step(model, plan, batch, profile, seed=seed, memo=memo)
        fast_times.append(time.perf_counter() - t)
        fast_steps.append(r.step_ms)

    exact_times, exact_steps = [], []
    for seed in range(WARM_SEEDS, WARM_SEEDS + min(args.repeat, 3)):
        t = time.perf_counter()
        r = simulate_step(model, plan, batch, profile, seed=seed, mode="exact", memo=memo)
        exact_times.append(time.perf_counter() - t)
        exact_steps.append(r.step_ms)

    worst = max(abs(f - e) / e for f, e in zip(fast_steps[:len(exact_steps)], exact_steps, strict=True))
    print("scenario: deepseek-r1 decode, mi300x, DP8/EP8, 512 seqs/rank, context 2100, DBO, graph")
    print(f"first call of the process (build graph + structure, load the compiled walk): "
          f"{cold_s * 1e3:8.1f} ms")
    print(f"cold shape (new context, structure known): median "
          f"{statistics.median(cold_times) * 1e3:7.2f} ms, min {min(cold_times) * 1e3:7.2f} ms "
          f"over {len(cold_times)} contexts")
    print(f"new context of a known batch and seed (the serving loop's grid points): median "
          f"{statistics.median(serving_times) * 1e3:7.2f} ms, min "
          f"{min(serving_times) * 1e3:7.2f} ms over {len(serving_times)} contexts")
    print(f"fast mode, warm:  median {statistics.median(fast_times) * 1e3:7.2f} ms, "
          f"min {min(fast_times) * 1e3:7.2f} ms over {len(fast_times)} seeds")
    print(f"exact mode:       median {statistics.median(exact_times) * 1e3:7.1f} ms, "
          f"min {min(exact_times) * 1e3:7.1f} ms over {len(exact_times)} seeds")
    print(f"step time, seed {WARM_SEEDS}: fast {fast_steps[0]:.3f} ms, exact "
          f"{exact_steps[0]:.3f} ms (first call, seed 0: {cold.step_ms:.3f} ms)")
    print(f"largest fast/exact step-time difference over {len(exact_steps)} seeds: "
          f"{worst * 100:.2e} %")
    print("breakdown (ms, seed 0): " + ", ".join(
        f"{k} {v:.2f}" for k, v in cold.breakdown_ms.items()))


if __name__ == "__main__":
    main()
