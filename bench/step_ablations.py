"""Print the step-time tables of docs/simulator.md: the acceptance scenario, its ablations, and DBO
at small and large batch. Every figure is a `simulate_step` run (fast mode, seed 0), the same as
`epsim step ... --json`.

    python bench/step_ablations.py
"""

from __future__ import annotations

from epsim.model import Batch, load_model, make_plan  # noqa: E402
from epsim.model.loads import read_loads  # noqa: E402
from epsim.sim.hardware.profile import load_profile  # noqa: E402
from epsim.sim.step.simulate import simulate_step  # noqa: E402

MODEL = load_model("deepseek-r1")
# the roofline alone (kernel set "none"): the tables of docs/simulator.md are its figures
MI300X = load_profile("mi300x", kernels="none")


def step(batch: int = 512, context: int = 2100, nodes: int = 1, loads=None, eplb: bool = True,
         **plan_options):
    world = nodes * 8
    plan = make_plan(MODEL, nodes=nodes, dp=world, ep=world, **plan_options)
    return simulate_step(MODEL, plan, Batch.decode(batch, context), MI300X, loads=loads,
                         eplb=eplb, seed=0)


def main() -> None:
    base = step()
    print("acceptance scenario: deepseek-r1, mi300x, DP8/EP8, 512/rank, context 2100, DBO, graph")
    for part, ms in base.breakdown_ms.items():
        print(f"  {part:<12} {ms:8.2f} ms")
    print(f"  {'step':<12} {base.step_ms:8.2f} ms; comm in flight "
          f"{sum(base.comm_busy_ms.values()):.2f} ms, exposed {base.exposed_comm_ms:.2f} ms, "
          f"interference {base.compute_slowdown_ms:.2f} ms, imbalance {base.expert_imbalance:.3f}")

    print("\nablations (step ms, delta vs baseline)")
    real = read_loads("decode_in2000out100")
    balanced = step(loads=real)
    rows = [
        ("--no-dbo", step(microbatches=1), base),
        ("--no-graph", step(graph_mode=False), base),
        ("--loads decode_in2000out100.json", balanced, base),
        ("--loads decode_in2000out100.json --no-eplb", step(loads=real, eplb=False), balanced),
        ("--kv-dtype bf16 --mem-fraction 0.95", step(kv_dtype="bf16", mem_fraction=0.95), base),
    ]
    for flags, r, ref in rows:
        delta = r.step_ms - ref.step_ms
        print(f"  {flags:<45} {r.step_ms:8.2f}  {delta:+7.2f} ({delta / ref.step_ms:+.1%})  "
              f"attention {r.breakdown_ms['attention']:.2f}  moe {r.breakdown_ms['moe_experts']:.2f}"
              f"  exposed comm {r.exposed_comm_ms:.2f}  imbalance {r.expert_imbalance:.3f}")

    print("\nDBO at small and large batch (step ms: DBO, no DBO, effect)")
    for label, kwargs in (("--batch 8 --context 2100", dict(batch=8)),
                          ("--batch 64 --context 2100", dict(batch=64)),
                          ("--batch 512 --context 2100", dict()),
                          ("--batch 1024 --context 1000", dict(batch=1024, context=1000)),
                          ("--nodes 2 --dp 16 --ep 16 --batch 512 --context 2100",
                           dict(nodes=2))):
        dbo, plain = step(**kwargs), step(microbatches=1, **kwargs)
        effect = dbo.step_ms / plain.step_ms - 1
        print(f"  {label:<55} {dbo.step_ms:8.2f} {plain.step_ms:8.2f}  "
              f"{'helps' if effect < 0 else 'hurts'}: {effect:+.1%}  "
              f"(no-DBO exposed comm {plain.exposed_comm_ms:.2f} ms)")


if __name__ == "__main__":
    main()
