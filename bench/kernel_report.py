"""The reference scenario under the measured kernel tables: before (roofline) and after, the
step's per-op-kind breakdown, the ablations, and how much each assumption moves the prediction.

    python bench/kernel_report.py            # markdown tables for docs/reproduce.md
    python bench/kernel_report.py --quick    # one concurrency, no sensitivity

The reference: DeepSeek-R1 on 8x MI300X, DP8 attention + EP8 experts, EPLB, DBO, graph replay,
FP8 KV, ``vllm bench serve`` style with 2000 in / 100 out at concurrency 4096 (one wave). The
report it is checked against measured 21,224.6 decode tok/s (docs/design.md section 1): a check,
never an input. Every figure here is simulated on this machine.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from epsim.model import Batch, load_model, make_plan
from epsim.model.errors import EpsimError
from epsim.model.plan import with_implied_fusions
from epsim.model.shipped import shipped_text
from epsim.sim.hardware.profile import load_profile
from epsim.sim.scenario import StepCache, run_scenario
from epsim.sim.spec import Scenario
from epsim.sim.step.simulate import simulate_step
from epsim.sim.workload.spec import WorkloadSpec

REPORT_4096 = 21224.6  # decode tok/s at concurrency 4096, the public report (a check)
MODEL = "deepseek-r1"


def scenario(hardware: str, kernels: str | None, concurrency: int = 4096, **change: Any
             ) -> Scenario:
    return Scenario.of(model=MODEL, hardware=hardware, dp=8, ep=8, kernels=kernels,
                    workload=WorkloadSpec(num_prompts=concurrency, isl=2000, osl=100,
                                          concurrency=concurrency)).with_(**change)


def step(hardware: str, kernels: str | None, batch: int = 512, context: int = 2100,
         dbo: bool = True, **options: Any) -> Any:
    """``epsim step --dp 8 --ep 8 --batch B --context C`` (synthetic skewed loads, seed 0)."""
    model = load_model(MODEL)
    profile = load_profile(hardware, kernels=kernels)
    plan = make_plan(model, dp=8, ep=8, microbatches=2 if dbo else 1, **options)
    plan = with_implied_fusions(plan, model, profile.plan_options)
    return simulate_step(model, plan, Batch.decode(batch, context), profile, seed=0)


def _kinds(r: Any) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(r.op_kinds_ms.items(),
                                                        key=lambda kv: -kv[1]) if v >= 0.05)


def before_after(hardware: str, sets: list[str], cache: StepCache) -> dict[str, dict]:
    """The 4096 benchmark and the 512-per-GPU step under each kernel set."""
    print(f"\n### {hardware}: the reference benchmark at 4096 per kernel set\n")
    print("| kernel set | decode_throughput (tok/s) | vs report | mean decode step (ms) | "
          "median ITL (ms) | step at 512/GPU, ctx 2100 (ms) | op kinds (ms per step) |")
    print("|---|---|---|---|---|---|---|")
    out = {}
    for name in sets:
        r = run_scenario(scenario(hardware, name), cache)
        s = step(hardware, name)
        out[name] = r
        print(f"| {name} | {r['decode_throughput']:,.1f} | "
              f"{r['decode_throughput'] / REPORT_4096 - 1:+.1%} | "
              f"{r['mean_decode_step_ms']:.2f} | {r['median_itl_ms']:.2f} | {s.step_ms:.2f} | "
              f"{_kinds(s)} |")
    return out


def ablations(hardware: str, kernels: str | None, cache: StepCache) -> None:
    print(f"\n### {hardware} ({kernels or 'default'} kernels): ablations at 4096\n")
    print("| at 4096 | decode_throughput (tok/s) | vs baseline | mean decode step (ms) | "
          "median ITL (ms) | expert imbalance | max running / GPU |")
    print("|---|---|---|---|---|---|---|")
    base = run_scenario(scenario(hardware, kernels), cache)
    for label, change in (("baseline (EPLB, DBO, graph, FP8 KV)", {}),
                          ("no DBO", {"dbo": False}), ("no graph", {"graph": False}),
                          ("no EPLB", {"eplb": False}), ("BF16 KV", {"kv_dtype": "bf16"})):
        r = base if not change else run_scenario(scenario(hardware, kernels, **change), cache)
        print(f"| {label} | {r['decode_throughput']:,.1f} | "
              f"{r['decode_throughput'] / base['decode_throughput'] - 1:+.1%} | "
              f"{r['mean_decode_step_ms']:.2f} | {r['median_itl_ms']:.2f} | "
              f"{r['expert_imbalance']:.3f} | {r['max_running_per_rank']} |")


def dbo_per_microbatch(hardware: str, kernels: str | None) -> None:
    """DBO's direction from the tables: each microbatch's ops at their own shapes."""
    print(f"\n### {hardware} ({kernels or 'default'} kernels): DBO by batch per GPU\n")
    print("| batch / GPU | step with DBO (ms) | without (ms) | DBO gain | fused MoE per layer, "
          "DBO (2 x half) vs one (us) | exposed comm with / without (ms) |")
    print("|---|---|---|---|---|---|")
    for batch in (64, 128, 256, 512):
        on, off = step(hardware, kernels, batch), step(hardware, kernels, batch, dbo=False)
        moe_on = on.op_kinds_ms.get("grouped_gemm", 0.0) / 58 * 1e3
        moe_off = off.op_kinds_ms.get("grouped_gemm", 0.0) / 58 * 1e3
        print(f"| {batch} | {on.step_ms:.2f} | {off.step_ms:.2f} | "
              f"{off.step_ms / on.step_ms - 1:+.1%} | {moe_on:.1f} vs {moe_off:.1f} | "
              f"{on.exposed_comm_ms:.2f} / {off.exposed_comm_ms:.2f} |")


def side_by_side_with_aiconfigurator(hardware: str = "h200") -> None:
    """epsim's decode step for aiconfigurator's configuration (DeepSeek-V3, DP8 + EP8 on one
    node, FP8 block-scale GEMMs and MoE, FP8 KV, context 2051 = its midpoint of 2000 in / 100
    out), with and without DBO, next to the figures aiconfigurator 0.12.0 printed (in
    docs/reproduce.md, with its commands)."""
    from epsim.model import accounting

    model = load_model("deepseek-v3")
    profile = load_profile(hardware)
    print(f"\n### {hardware} ({profile.kernel_set} kernels): DeepSeek-V3 DP8+EP8 decode step, "
          "context 2051\n")
    print("| batch / GPU | KV fits | step, DBO (ms) | step, no DBO (ms) | no DBO, BF16 KV (ms) "
          "| op kinds, no DBO (ms) |")
    print("|---|---|---|---|---|---|")
    for batch in (64, 128, 256, 512):
        runs = []
        for dbo, kv in ((True, "fp8"), (False, "fp8"), (False, "bf16")):
            plan = make_plan(model, dp=8, ep=8, microbatches=2 if dbo else 1, kv_dtype=kv)
            plan = with_implied_fusions(plan, model, profile.plan_options)
            runs.append(simulate_step(model, plan, Batch.decode(batch, 2051), profile, seed=0))
        plan = plan.with_(kv_dtype="fp8")
        need = accounting.kv_bytes_for_sequence(model, plan.kv_dtype, 2051, 1) * batch
        try:
            budget = accounting.memory_budget(model, plan, profile.hbm_bytes)
        except EpsimError:  # simulated anyway, as aiconfigurator's static mode does
            fits = "no (the weights do not fit)"
        else:
            fits = "yes" if need <= budget.kv_bytes else f"no ({need / 1e9:.0f} > " \
                f"{budget.kv_bytes / 1e9:.0f} GB)"
        print(f"| {batch} | {fits} | {runs[0].step_ms:.2f} | {runs[1].step_ms:.2f} | "
              f"{runs[2].step_ms:.2f} | {_kinds(runs[1])} |")


# --------------------------------------------------------------------------------------------
# Sensitivity: each documented assumption at its low and high value
# --------------------------------------------------------------------------------------------


@contextmanager
def edited_profile(name: str, edit: Callable[[dict], None]) -> Iterator[str]:
    """A temporary copy of shipped profile ``name`` changed by ``edit`` (a path to load)."""
    obj = json.loads(shipped_text("epsim.sim.hardware", "profiles", name))
    edit(obj)
    with tempfile.TemporaryDirectory(prefix="epsim-sens-") as folder:
        path = Path(folder, f"{name}.json")
        path.write_text(json.dumps(obj))
        yield str(path)


def _set_decode_rate(fp8: float) -> Callable[[dict], None]:
    def edit(obj: dict) -> None:
        obj["efficiency"]["attention_decode_flops"] = {"fp8": fp8, "bf16": fp8 / 2}
    return edit


def _scale_tables(kinds: tuple[str, ...], factor: float) -> Callable[[dict], None]:
    def edit(obj: dict) -> None:
        for kset in obj.get("kernels", {}).get("sets", {}).values():
            for table in kset.get("tables", []):
                if table["op"] in kinds:
                    n = len(table["features"])
                    for point in table["points"]:
                        point[n] = point[n] * factor
    return edit


def _mi325x_rows(factor: float) -> Callable[[dict], None]:
    """MI300X's fused-MoE and GEMM tables replaced by MI325X's own rows times ``factor``."""
    donor = json.loads(shipped_text("epsim.sim.hardware", "profiles", "mi325x"))

    def edit(obj: dict) -> None:
        mine = obj["kernels"]["sets"][obj["kernels"]["default"]]
        theirs = donor["kernels"]["sets"][donor["kernels"]["default"]]
        keep = [t for t in mine["tables"] if t["op"] not in ("grouped_gemm", "gemm")]
        moved = [copy.deepcopy(t) for t in theirs["tables"] if t["op"] in ("grouped_gemm", "gemm")]
        for t in moved:
            n = len(t["features"])
            for point in t["points"]:
                point[n] = point[n] * factor
        mine["tables"] = keep + moved
        obj["kernels"]["sources"].update(donor["kernels"]["sources"])
    return edit


def _host_per_step(seconds: float) -> Callable[[dict], None]:
    """A host time per step outside the GPU's work, charged as the graph launch is."""
    def edit(obj: dict) -> None:
        obj["efficiency"]["graph_launch_s"] = seconds
    return edit


def _graph_node(seconds: float) -> Callable[[dict], None]:
    def edit(obj: dict) -> None:
        obj["efficiency"]["graph_node_s"] = seconds
    return edit


SENSITIVITY: tuple[tuple[str, str, Callable[[dict], None], str, Callable[[dict], None]], ...] = (
    ("nhead-128 MLA decode rate (no table at batch 256-512: the nhead-64 kernel's 367 TFLOP/s)",
     "183.5 TFLOP/s (half)", _set_decode_rate(183.5e12),
     "660 TFLOP/s (FlashMLA's compute-bound rate)", _set_decode_rate(660e12)),
    ("MI325X-tuned fused-MoE / GEMM rows on MI300X (bandwidth transfer rule)",
     "MI325X times as measured (no transfer)", _mi325x_rows(1.0),
     "every row x 6.0/5.3 (fully bandwidth-bound)", _mi325x_rows(6.0 / 5.3)),
    ("dispatch / combine in situ vs MORI's unit benchmark",
     "x 0.8", _scale_tables(("dispatch", "combine"), 0.8),
     "x 1.25", _scale_tables(("dispatch", "combine"), 1.25)),
    ("GPU gap between graph kernels (graph_node_s, an estimate: 1 us)",
     "0.5 us", _graph_node(0.5e-6), "2 us", _graph_node(2e-6)),
    ("host time per step not overlapped (not modelled: 4.5 us, one graph launch)",
     "2 ms", _host_per_step(2e-3), "5 ms", _host_per_step(5e-3)),
)


def sensitivity(hardware: str, cache: StepCache) -> None:
    base = run_scenario(scenario(hardware, None), cache)["decode_throughput"]
    print(f"\n### {hardware}: sensitivity of the reference prediction ({base:,.1f} tok/s)\n")
    print("| assumption | low | decode tok/s (vs base) | high | decode tok/s (vs base) |")
    print("|---|---|---|---|---|")
    for what, low_label, low, high_label, high in SENSITIVITY:
        cells = []
        for edit in (low, high):
            try:
                with edited_profile(hardware, edit) as path:
                    v = run_scenario(scenario(path, None), StepCache())["decode_throughput"]
                cells.append(f"{v:,.1f} ({v / base - 1:+.1%})")
            except KeyError:  # the profile has no such table
                cells.append("n/a")
        print(f"| {what} | {low_label} | {cells[0]} | {high_label} | {cells[1]} |")


def main(argv: list[str]) -> None:
    cache = StepCache()
    hardware = "mi300x"
    sets = list(load_profile(hardware).kernel_sets)
    before_after(hardware, sets, cache)
    if "--quick" in argv:
        return
    ablations(hardware, None, cache)
    ablations(hardware, "none", cache)
    dbo_per_microbatch(hardware, None)
    dbo_per_microbatch(hardware, "none")
    sensitivity(hardware, cache)
    for gpu in ("h200", "h100"):
        side_by_side_with_aiconfigurator(gpu)


if __name__ == "__main__":
    main(sys.argv[1:])
