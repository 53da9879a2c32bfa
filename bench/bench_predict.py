"""How long the serving simulation takes: the acceptance command of issue 4 and a sweep.

Run from the repository root:  python bench/bench_predict.py  (``--reproduce``: the tables of
docs/reproduce.md instead)

Prints, for DeepSeek-R1 on 8x MI300X (DP8/EP8, 2000 in / 100 out, 4096 prompts at concurrency
4096), ``sim_wall_s`` (the simulation's own wall time, target <= 10 s), the step simulations it
needed, and the headline figures; then the same for a concurrency sweep sharing one step cache.
"""

from __future__ import annotations

import sys
import time

from epsim.sim.scenario import StepCache, run_scenario  # noqa: E402
from epsim.sim.spec import Scenario  # noqa: E402
from epsim.sim.workload.spec import WorkloadSpec  # noqa: E402


def scenario(concurrency: int) -> Scenario:
    return Scenario.of(model="deepseek-r1", hardware="mi300x", dp=8, ep=8,
                    workload=WorkloadSpec(num_prompts=concurrency, isl=2000, osl=100,
                                          concurrency=concurrency))


REPORT_4096 = 21224.6  # output tok/s at concurrency 4096 (decode time only), the public report
REPORT_LOW_LATENCY_ITL = 91.48  # median ITL (ms) of its lowest-latency setting


def reproduce() -> None:
    """The tables of docs/reproduce.md, as markdown."""
    cache = StepCache()
    rows = [run_scenario(scenario(c), cache) for c in (1024, 2048, 3072, 4096)]
    top = max(r["decode_throughput"] for r in rows)
    print("| concurrency | decode_throughput (tok/s) | output_throughput (tok/s) | "
          "median ITL (ms) | p90 ITL (ms) | mean decode step (ms) | median TTFT (s) | "
          "decode tput / best |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['max_concurrency']} | {r['decode_throughput']:,.1f} | "
              f"{r['output_throughput']:,.1f} | {r['median_itl_ms']:.2f} | {r['p90_itl_ms']:.2f} | "
              f"{r['mean_decode_step_ms']:.2f} | {r['median_ttft_ms'] / 1e3:.1f} | "
              f"{r['decode_throughput'] / top:.2f} |")
    base = rows[-1]
    print(f"\nreport at 4096: {REPORT_4096:,.1f} tok/s; predicted decode_throughput "
          f"{base['decode_throughput']:,.1f} ({base['decode_throughput'] / REPORT_4096 - 1:+.1%})")
    print("\n| at 4096 | decode_throughput (tok/s) | vs baseline | median ITL (ms) | "
          "mean decode step (ms) | expert imbalance | KV usage (max) | max running / rank |")
    print("|---|---|---|---|---|---|---|---|")
    variants = [("baseline (EPLB, DBO, graph, FP8 KV)", {}), ("no EPLB", {"eplb": False}),
                ("no DBO", {"dbo": False}), ("no graph", {"graph": False}),
                ("BF16 KV", {"kv_dtype": "bf16"})]
    for name, change in variants:
        r = base if not change else run_scenario(scenario(4096).with_(**change), cache)
        print(f"| {name} | {r['decode_throughput']:,.1f} | "
              f"{r['decode_throughput'] / base['decode_throughput'] - 1:+.1%} | "
              f"{r['median_itl_ms']:.2f} | {r['mean_decode_step_ms']:.2f} | "
              f"{r['expert_imbalance']:.3f} | {r['max_kv_cache_usage']:.2f} | "
              f"{r['max_running_per_rank']} |")
    print("\nstep breakdown at 4096 (ms): " + ", ".join(
        f"{k} {v:.2f}" for k, v in base["step_breakdown_ms"].items()))


def main() -> None:
    if "--reproduce" in sys.argv:
        reproduce()
        return
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
