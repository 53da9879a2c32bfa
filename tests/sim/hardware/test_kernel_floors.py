"""The kernel inventory's costs: each kernel's floor on the device, and an eager host's launch and
framework dispatch per kernel (sim/hardware/kernel_inventory.py, sim/step/kernels.py)."""

import copy

import pytest

from epsim.model import Batch, load_model, make_plan
from epsim.model.graph import build_step_graph
from epsim.sim.hardware.kernel_inventory import INVENTORIES, kernels_of
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.kernels import floored, host_launch, kernel_count
from epsim.sim.step.simulate import simulate_step

TINY = load_model("tiny-deepseek")
MI = load_profile("mi300x")


def planted(kernel_set: str, **efficiency) -> "object":
    """MI300X with planted efficiency figures and ``kernel_set`` selected."""
    raw = copy.deepcopy(dict(MI.raw))
    raw["efficiency"].update(efficiency)
    for key in efficiency:
        raw["sources"][f"efficiency.{key}"] = "planted by the test"
    return profile_from_dict(raw).with_kernels(kernel_set)


def test_floored_by_hand():
    # the main kernel at least the floor (which holds the 1 us graph gap), 1 auxiliary at 3 us
    assert floored(1e-6, 2, 3e-6, 1e-6) == pytest.approx(2e-6 + 3e-6)
    # a main kernel above the floor keeps its time; 3 auxiliary kernels: 9 us
    assert floored(10e-6, 4, 3e-6, 1e-6) == pytest.approx(19e-6)
    assert floored(1e-6, 0, 3e-6, 1e-6) == 1e-6   # fused into a neighbour
    assert floored(1e-6, 3, 0.0, 1e-6) == 1e-6    # no floor in the profile (CPU, calibrated)


def test_inventory_lookup_name_then_kind():
    assert kernels_of("aiter", "gemm", "attn.q_b") == ("act_quant_fp8", "gemm_fp8")
    assert kernels_of("aiter", "gemm", "attn.kv_a") == ()   # vLLM's fused_qkv_a_proj
    assert kernels_of("aiter", "norm", "attn_norm") == ("fused_add_rmsnorm",)
    assert len(kernels_of("aiter", "attention_decode", "attn.core")) == 4
    assert kernels_of("none", "norm", "attn_norm") == ("norm",)
    for inv in INVENTORIES.values():
        assert inv.source and inv.engine
        assert all(isinstance(k, tuple) for k in inv.kernels.values())


def _single_gpu_step(profile, graph_mode=True):
    plan = make_plan(TINY, dp=1, ep=1, gpus_per_node=1, microbatches=1, graph_mode=graph_mode)
    batch = Batch.decode(2, 16)
    graph = build_step_graph(TINY, plan, batch)
    ops = [graph.ops[o] for o in graph.schedule.order()]
    return plan, batch, ops


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_tiny_step_is_kernels_times_floor(mode):
    # a 1 ms floor: every op of the tiny model is far below it, so with one kernel per op (the
    # "none" set) each op costs the floor, and the step is one graph launch + ops x floor
    floor = 1e-3
    prof = planted("none", kernel_floor_s=floor)
    plan, batch, ops = _single_gpu_step(prof)
    assert not any(op.is_collective for op in ops)
    r = simulate_step(TINY, plan, batch, prof, mode=mode, synthetic="uniform")
    expected = prof.efficiency.graph_launch_s + len(ops) * floor
    assert r.step_ms == pytest.approx(expected * 1e3, rel=1e-9)


def test_tiny_step_with_the_aiter_inventory():
    # aiter: each op costs its kernels x floor; the ops fused into a neighbour (no kernels) keep
    # their own (microsecond) time and the graph gap
    floor = 1e-3
    prof = planted("aiter", kernel_floor_s=floor)
    plan, batch, ops = _single_gpu_step(prof)
    counts = [kernel_count(op, prof) for op in ops]
    fused = counts.count(0)
    expected = prof.efficiency.graph_launch_s + sum(counts) * floor
    r = simulate_step(TINY, plan, batch, prof, synthetic="uniform")
    assert sum(counts) > len(ops)  # quantisation, sort, reduce: more kernels than ops
    assert expected * 1e3 <= r.step_ms <= (expected + fused * 50e-6) * 1e3


def test_no_graph_costs_each_kernels_launch_and_dispatch():
    # the host is the bottleneck when every kernel's launch + dispatch (planted 1 ms) outweighs
    # the GPU's work: the eager step is the sum of the launches, then the last op
    launch = 1e-3
    prof = planted("aiter", framework_dispatch_s=launch - MI.kernel_launch_s)
    plan, batch, ops = _single_gpu_step(prof, graph_mode=False)
    counts = [kernel_count(op, prof) for op in ops]
    issue = host_launch(ops, prof, captured=False)
    assert issue.tolist() == pytest.approx([c * launch for c in counts])
    assert host_launch(ops, prof, captured=True).sum() == 0
    eager = simulate_step(TINY, plan, batch, prof, synthetic="uniform")
    graph = simulate_step(TINY, make_plan(TINY, dp=1, ep=1, gpus_per_node=1, microbatches=1),
                          batch, prof, synthetic="uniform")
    # the last op starts when the host has issued it and runs for well under the 1 ms launch
    assert sum(counts) * launch * 1e3 <= eager.step_ms <= (sum(counts) * launch + 1e-3) * 1e3
    assert eager.step_ms > graph.step_ms + (sum(counts) * launch - 1e-3) * 1e3
    exact = simulate_step(TINY, plan, batch, prof, synthetic="uniform", mode="exact")
    assert exact.step_ms == pytest.approx(eager.step_ms, rel=1e-9)


def test_decode_step_no_graph_slower_by_the_sourced_launch():
    # the shipped MI300X figures: a TP1 decode step of the tiny model is host-bound outside a
    # graph, so --no-graph costs every kernel's 4.5 us launch + 4.5 us dispatch
    plan, batch, ops = _single_gpu_step(MI, graph_mode=False)
    per_kernel = MI.kernel_launch_s + MI.efficiency.framework_dispatch_s
    assert per_kernel == pytest.approx(9e-6)
    kernels = sum(kernel_count(op, MI) for op in ops)
    eager = simulate_step(TINY, plan, batch, MI, synthetic="uniform")
    graph = simulate_step(TINY, make_plan(TINY, dp=1, ep=1, gpus_per_node=1, microbatches=1),
                          batch, MI, synthetic="uniform")
    assert eager.step_ms > graph.step_ms
    # host-bound (9 us per kernel against ~4.2 us on the GPU): the host issues every kernel,
    # then the GPU runs the last op, sampling's 3 kernels at their floor (3.2169 us each)
    assert ops[-1].name == "sample" and kernel_count(ops[-1], MI) == 3
    floor = MI.efficiency.kernel_floor_s
    assert eager.step_ms == pytest.approx((kernels * per_kernel + 3 * floor) * 1e3, rel=1e-9)


def test_explain_lists_the_inventory():
    plan, batch, _ = _single_gpu_step(MI)
    r = simulate_step(TINY, plan, batch, MI, synthetic="uniform", explain=True)
    inv = r.to_json()["kernel_inventory"]
    assert inv["kernel_set"] == "aiter" and "deepseek_v2.py" in inv["source"]
    assert inv["kernel_floor_s"] == pytest.approx(3.2169e-6)
    assert inv["framework_dispatch_s"] == 0.0  # captured graph: no host dispatch
    assert inv["ops"]["attn.q_b"]["kernels"] == ["act_quant_fp8", "gemm_fp8"]
    assert inv["kernels_per_step"] == sum(len(e["kernels"]) * e["count"]
                                          for e in inv["ops"].values())


def test_routed_fused_moe_keeps_its_kernels_floors():
    # under EP the fused MoE is re-timed from the sampled routing: it still costs its 4 aiter
    # kernels (sort, quantise, two stages) at the planted 1 ms floor each (the main kernel's
    # floor holds its graph gap)
    floor = 1e-3
    prof = planted("aiter", kernel_floor_s=floor)
    plan = make_plan(TINY, dp=2, ep=2, gpus_per_node=2, microbatches=1)
    r = simulate_step(TINY, plan, Batch.decode(4, 16), prof, synthetic="uniform", trace=True)
    moe = [e for e in r.events if e.kind == "grouped_gemm" and e.stream == "compute"]
    assert moe and len(kernels_of("aiter", "grouped_gemm", "moe.experts")) == 4
    for e in moe:
        assert e.dur_us == pytest.approx(4 * floor * 1e6)


def test_the_fused_moes_kernels_follow_the_deployed_grouped_gemm():
    # SGLang on NVIDIA: DeepGEMM masked under the low-latency exchange (4 kernels), contiguous
    # under the normal one (8), the Triton fused MoE for TP-only MoE (7)
    masked = kernels_of("sglang", "grouped_gemm", "moe.experts", ("ep", "low_latency"))
    contiguous = kernels_of("sglang", "grouped_gemm", "moe.experts", ("ep", "normal"))
    triton = kernels_of("sglang", "grouped_gemm", "moe.experts", ("tp", ""))
    assert (len(masked), len(contiguous), len(triton)) == (4, 8, 7)
    assert masked[0] == "m_grouped_gemm_masked_gate_up" and "ep_scatter" in contiguous
    assert kernels_of("sglang", "norm", "norm", ("ep", "low_latency")) == ("fused_add_rmsnorm",)
    # a two-node EP16 decode step runs the low-latency exchange: its inventory says masked
    model = load_model("deepseek-v3")
    plan = make_plan(model, nodes=2, gpus_per_node=8, dp=16, ep=16)
    out = simulate_step(model, plan, Batch.decode(64, 1000), load_profile("h100"), explain=True)
    assert out.to_json()["kernel_inventory"]["ops"]["moe.experts"]["kernels"] == list(masked)
