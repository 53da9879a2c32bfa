"""How long the serving simulation takes: the acceptance command of issue 4 and a sweep.

Run from the repository root:  python bench/bench_predict.py

Prints, for DeepSeek-R1 on 8x MI300X (DP8/EP8, 2000 in / 100 out, 4096 prompts at concurrency
4096), ``sim_wall_s`` (the simulation's own wall time, target <= 10 s), the step simulations it
needed, and the headline figures; then the same for a concurrency sweep sharing one step cache.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.search import Scenario, StepCache, run_scenario  # noqa: E402
from sim.workload import WorkloadSpec  # noqa: E402


def scenario(concurrency: int) -> Scenario:
    return Scenario(model="deepseek-r1", hardware="mi300x", dp=8, ep=8,
                    workload=WorkloadSpec(num_prompts=concurrency, isl=2000, osl=100,
                                          max_concurrency=concurrency))


def main() -> None:
    r = run_scenario(scenario(4096))
    print("epsim predict --model deepseek-r1 --hardware mi300x --dp 8 --ep 8 --concurrency 4096 "
          "--num-prompts 4096 --isl 2000 --osl 100")
    print(f"  sim_wall_s          {r['sim_wall_s']:.2f} s (target <= 10 s)")
    print(f"  step_sim_calls      {r['step_sim_calls']}")
    print(f"  steps               {r['num_steps']}")
    print(f"  output_throughput   {r['output_throughput']:,.1f} tok/s")
    print(f"  decode_throughput   {r['decode_throughput']:,.1f} tok/s")
    print(f"  median_itl_ms       {r['median_itl_ms']:.2f}")
    cache = StepCache()
    t0 = time.perf_counter()
    for c in (1024, 2048, 3072, 4096):
        r = run_scenario(scenario(c), cache)
        print(f"  sweep c={c:<5} sim_wall_s {r['sim_wall_s']:.2f} s, step sims "
              f"{r['step_sim_calls']}")
    print(f"  sweep total         {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
