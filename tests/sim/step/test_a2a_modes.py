"""EP exchange modes (sim/hardware/a2a.py): node-then-GPU traffic on hand-computed cases, the low-latency
kernels' missing comm interference, the mode-tagged internode tables, and single-node results
that no mode changes."""

from dataclasses import replace

import numpy as np
import pytest
from test_sim_executor import both, program

from epsim.model import Batch, build_step_graph, load_model, make_plan
from epsim.model.errors import EpsimError
from epsim.sim.hardware import a2a
from epsim.sim.hardware.kernel_sets import lookup, parse_kernels
from epsim.sim.hardware.profile import load_profile
from epsim.sim.step.cost import comm
from epsim.sim.step.executor import run_exact, run_fast
from epsim.sim.step.routing import RoutingSample, node_tokens, once_per_destination
from epsim.sim.step.simulate import simulate_step

R1 = load_model("deepseek-r1")
LL, NORMAL = a2a.A2A_MODES["low_latency"], a2a.A2A_MODES["normal"]


# -- the modes ---------------------------------------------------------------------------------


def test_auto_is_sglang_deepep_auto_across_nodes_and_normal_within_one():
    assert a2a.resolve("auto", "decode", spans_nodes=True) is LL
    assert a2a.resolve("auto", "prefill", spans_nodes=True) is NORMAL
    assert a2a.resolve("auto", "decode", spans_nodes=False) is NORMAL
    assert a2a.resolve("auto", "prefill", spans_nodes=False) is NORMAL
    assert a2a.resolve("low_latency", "prefill", spans_nodes=True) is LL
    assert not LL.occupies_cus and not LL.hierarchical
    assert NORMAL.occupies_cus and NORMAL.hierarchical
    with pytest.raises(EpsimError, match="choose one of auto, low_latency, normal"):
        a2a.resolve("pure_rdma", "decode", spans_nodes=True)
    with pytest.raises(EpsimError, match="unknown a2a mode"):
        load_profile("h800", a2a_mode="fast")


def test_node_layout_needs_equal_node_major_nodes():
    assert a2a.node_layout(np.array([0, 0, 1, 1])) == (2, 2)
    assert a2a.node_layout(np.zeros(8, dtype=int)) is None  # one node: nothing to forward
    assert a2a.node_layout(np.array([0, 0, 0, 1])) is None  # unequal nodes


# -- node-then-GPU traffic, by hand ------------------------------------------------------------

# 2 nodes x 2 GPUs: members 0, 1 on node 0, members 2, 3 on node 1
TOKENS = np.arange(1.0, 17.0).reshape(4, 4)  # rank s -> GPU d token copies
NODE_TOKENS = np.array([[0.0, 5.0], [0.0, 6.0], [7.0, 0.0], [8.0, 0.0]])  # rank s -> node b


def test_hierarchical_traffic_two_nodes_by_hand():
    t = a2a.hierarchical_traffic(TOKENS, NODE_TOKENS, 2)
    # inside node 0: 0 -> 1 carries its own 2 rows plus 10 that member 2 (remote, local index
    # 0) sent to member 1 through member 0; 1 -> 0: 5 own + 13 from member 3 through member 1
    assert t[0, 1] == 2 + 10 and t[1, 0] == 5 + 13
    assert t[2, 3] == 12 + 4 and t[3, 2] == 15 + 7
    # between nodes only same-index pairs carry, one row per token and destination node
    assert (t[0, 2], t[1, 3], t[2, 0], t[3, 1]) == (5, 6, 7, 8)
    assert t[0, 3] == t[1, 2] == t[2, 1] == t[3, 0] == 0
    # leading axes (layers, microbatches) are independent
    t2 = a2a.hierarchical_traffic(np.stack([TOKENS, 2 * TOKENS]),
                                  np.stack([NODE_TOKENS, 2 * NODE_TOKENS]), 2)
    np.testing.assert_array_equal(t2[1], 2 * t)


def test_link_traffic_combine_is_the_dispatch_reversed_and_flat_is_untouched():
    nodes = np.array([0, 0, 1, 1])
    hier = a2a.link_traffic("dispatch", NORMAL, TOKENS, nodes, lambda: NODE_TOKENS)
    back = a2a.link_traffic("combine", NORMAL, TOKENS, nodes, lambda: NODE_TOKENS)
    np.testing.assert_array_equal(back, hier.T)
    flat = a2a.link_traffic("dispatch", LL, TOKENS, nodes, lambda: pytest.fail("not needed"))
    np.testing.assert_array_equal(flat, TOKENS)
    one_node = a2a.link_traffic("dispatch", NORMAL, TOKENS, np.zeros(4, dtype=int),
                                lambda: pytest.fail("not needed"))
    np.testing.assert_array_equal(one_node, TOKENS)


def test_collective_time_of_the_two_node_case_by_hand():
    p = load_profile("h800", kernels="none")
    e = p.efficiency
    nodes = np.array([0, 0, 1, 1])
    row = 1000.0
    hier = a2a.hierarchical_traffic(TOKENS, NODE_TOKENS, 2) * row
    # switch: the busiest GPU port; member 3 receives 16 rows and sends 22 inside node 1
    t_intra = 22 * row / e.link_bandwidth_usable
    t_nic = 8 * row / e.nic_bandwidth_usable  # member 3 sends 8, member 1 receives 8
    assert float(comm.collective_time("dispatch", hier, p, nodes, captured=True)) == \
        pytest.approx(e.a2a_latency_s + max(t_intra, t_nic), rel=1e-12)


def test_node_tokens_count_a_token_once_per_node():
    # one layer, one microbatch, 4 ranks of 10 tokens, top-2: rank 0 sends 6 and 4 of its 20
    # pairs to GPUs 2 and 3 (node 1): 10 pairs there
    pairs = np.zeros((1, 1, 4, 4))
    pairs[0, 0, 0] = [6.0, 4.0, 6.0, 4.0]
    sample = RoutingSample(layers=np.array([3]), slot_pairs=np.zeros((1, 1, 4)), pairs=pairs,
                           tokens=np.zeros_like(pairs), slots_per_gpu=1)
    nt = node_tokens(sample, np.array([[10.0]]), k=2, gpus_per_node=2)
    assert nt.shape == (1, 1, 4, 2)
    # 10 tokens, half their 20 pairs on node 1: 10 * (1 - (1 - 10/20)**2) = 7.5
    assert nt[0, 0, 0, 1] == pytest.approx(7.5)
    assert once_per_destination(np.array(6.0), 10.0, 2) == pytest.approx(10 * (1 - 0.7 ** 2))


def test_nominal_hierarchical_dispatch_two_nodes_by_hand():
    # R1 on 2 nodes of 2 GPUs, 64 decode tokens per rank, one microbatch
    plan = make_plan(R1, nodes=2, gpus_per_node=2, dp=4, ep=4, microbatches=1)
    graph = build_step_graph(R1, plan, Batch.decode(64, 1000))
    op = next(o for o in graph.ops.values() if o.kind == "dispatch" and o.draft is None)
    d = op.dims
    p = load_profile("h800", kernels="none")
    e = p.efficiency
    nodes = np.array([0, 0, 1, 1])
    per_peer, row = d["expected_tokens_per_peer"], d["bytes_per_token"]
    node_hit = 64 * (1 - (1 - 2 / 4) ** 8)  # the other node holds half the experts
    # node-then-GPU: a port carries its own rows to its one local peer plus those it forwards
    # for its remote twin (2 x per_peer); the NIC one row per token for the other node
    want = e.a2a_latency_s + max(2 * per_peer * row / e.link_bandwidth_usable,
                                 node_hit * row / e.nic_bandwidth_usable)
    got = comm.nominal_collective(op, p, nodes, True, NORMAL)
    assert got == pytest.approx(want, rel=1e-12)
    # flat: 1 local peer over the fabric, 2 remote peers each over the NIC
    flat = e.a2a_latency_s + max(per_peer * row / e.link_bandwidth_usable,
                                 2 * per_peer * row / e.nic_bandwidth_usable)
    assert comm.nominal_collective(op, p, nodes, True, LL) == pytest.approx(flat, rel=1e-12)
    assert got < flat  # the node-level de-duplication halves the NIC bytes here


# -- comm interference -------------------------------------------------------------------------


def test_a_quiet_collective_slows_no_compute():
    # a 2 s compute op inside a 10 s collective at half speed takes 4 s; quiet, 2 s
    ops = [("x", "x", "combine", (), 10.0), ("a", "c", "attention", (), 2.0)]
    loud = both(program(ops, ranks=2, slowdown=0.5))
    np.testing.assert_allclose(loud.end[1], [4.0, 4.0])
    prog = replace(program(ops, ranks=2, slowdown=0.5), quiet=np.array([True, False]))
    for tl in (run_fast(prog), run_fast(prog, fold=False), run_exact(prog)):
        np.testing.assert_allclose(tl.end[1], [2.0, 2.0])
        np.testing.assert_allclose(tl.slowdown_s, [0.0, 0.0])


def _multinode_step(mode, phase="decode"):
    profile = load_profile("h800", a2a_mode=mode)
    plan = make_plan(R1, nodes=2, dp=16, ep=16)
    batch = Batch.decode(64, 1000) if phase == "decode" else Batch.prefill(2, 512)
    return simulate_step(R1, plan, batch, profile)


def test_low_latency_exchanges_charge_no_compute_slowdown():
    ll = _multinode_step("low_latency")
    normal = _multinode_step("normal")
    assert ll.a2a_mode == "low_latency" and normal.a2a_mode == "normal"
    assert ll.compute_slowdown_ms == pytest.approx(0.0, abs=1e-9)
    assert normal.compute_slowdown_ms > 0.01
    assert _multinode_step("auto").step_s == ll.step_s
    assert _multinode_step("auto", "prefill").a2a_mode == "normal"


def test_internode_tables_time_only_their_mode():
    p = load_profile("mi300x")
    ks = p.kernels
    ll = ks.resolve("aiter", "dispatch", "fp8", "inter", "low_latency")[0]
    assert ll is not None and ll.mode == "low_latency"
    assert lookup(ll, {"tokens": 128, "ranks": 16, "hidden": 7168})[0] == 76e-6
    assert ks.resolve("aiter", "combine", "bf16", "inter", "low_latency")[0].seconds.tolist() \
        == [122e-6, 280e-6]
    assert ks.resolve("aiter", "dispatch", "fp8", "inter", "normal")[0] is None
    # intra-node tables carry no mode: every mode uses them, as before modes existed
    assert ks.resolve("aiter", "dispatch", "fp8", "intra", "normal")[0].mode == ""
    h800 = load_profile("h800").kernels
    assert h800.resolve("deepseek", "dispatch", "fp8", "inter", "low_latency")[0] is not None
    assert h800.resolve("deepseek", "dispatch", "fp8", "inter", "normal")[0] is None


def test_a_table_mode_must_be_known_and_on_an_exchange():
    def kernels(table):
        return {"default": "t", "sources": {"s": {"url": "https://example.org", "note": ""}},
                "sets": {"t": {"description": "", "tables": [table]}}}

    a2a_table = {"op": "dispatch", "dtype": "fp8", "unit": "us", "source": "s", "scope": "inter",
                 "features": ["tokens", "ranks", "hidden"], "points": [[128, 16, 7168, 76.0]]}
    assert parse_kernels(kernels({**a2a_table, "mode": "low_latency"})).sets["t"].table(
        "dispatch", "fp8", "inter", "low_latency").mode == "low_latency"
    with pytest.raises(EpsimError, match="mode must be one of low_latency, normal"):
        parse_kernels(kernels({**a2a_table, "mode": "fast"}))
    gemm = {"op": "gemm", "dtype": "fp8", "unit": "us", "source": "s", "mode": "normal",
            "features": ["m", "n", "k"], "points": [[1, 2, 3, 4.0]]}
    with pytest.raises(EpsimError, match="tables of combine, dispatch, grouped_gemm only"):
        parse_kernels(kernels(gemm))


# -- single node: no mode changes a number -----------------------------------------------------


@pytest.mark.parametrize("kernels", [None, "none"])
def test_single_node_auto_and_normal_are_the_model_before_modes(kernels):
    plan = make_plan(R1, nodes=1, dp=8, ep=8)
    batch = Batch.decode(128, 2100)
    auto = simulate_step(R1, plan, batch, load_profile("mi300x", kernels=kernels))
    normal = simulate_step(R1, plan, batch, load_profile("mi300x", kernels=kernels,
                                                         a2a_mode="normal"))
    assert auto.a2a_mode == "normal"
    assert auto.step_s == normal.step_s and auto.rank_ms == normal.rank_ms
    assert auto.compute_slowdown_ms > 0  # the comm kernels still hold CUs
    # low_latency in one node: the same exchange times, no interference
    ll = simulate_step(R1, plan, batch, load_profile("mi300x", kernels=kernels,
                                                     a2a_mode="low_latency"))
    assert ll.op_kinds_ms["dispatch"] == auto.op_kinds_ms["dispatch"]
    assert ll.compute_slowdown_ms == pytest.approx(0.0, abs=1e-9)
    assert ll.step_s < auto.step_s


def test_a_decode_batch_beside_a_prefill_runs_its_exchanges_as_the_prefill():
    # one all-to-all runs in one mode: across nodes, auto makes a step with any prefilling rank
    # run every rank's exchanges in the prefill's (normal) mode, as SGLang's OR over DP ranks
    from dataclasses import replace

    from epsim.sim.deployment import resolve_deployment
    from epsim.sim.scenario import StepCache, engine_step_time
    from epsim.sim.serving.step_time import StepPolicy
    from epsim.sim.spec import Scenario
    from epsim.sim.workload.spec import WorkloadSpec

    assert a2a.with_prefill_choice("auto", True) == "normal"
    assert a2a.with_prefill_choice("auto", False) == "auto"  # the phases agree: no new model
    assert a2a.with_prefill_choice("low_latency", True) == "low_latency"

    class Recording(StepCache):
        def get(self, model, plan, profile, sc):
            self.modes.append(profile.a2a_mode)
            return super().get(model, plan, profile, sc)

    class Settings:
        def step_policy(self, graph):
            return StepPolicy()

    r1 = load_model("deepseek-r1")
    plan = make_plan(r1, dp=16, ep=16, nodes=2)
    sc = Scenario.of(model="deepseek-r1", hardware="mi300x", dp=16, ep=16, nodes=2,
                  workload=WorkloadSpec(num_prompts=8, isl=500, osl=8))
    cache = Recording()
    cache.modes = []
    resolved = replace(resolve_deployment(sc.deployment), engine=Settings())
    engine = engine_step_time(cache, resolved, plan, sc)
    alone = engine.decode(8, 500)
    beside = engine.decode(8, 500, any_prefill=True)
    assert cache.modes == ["auto", "normal"]
    assert beside.seconds != alone.seconds  # the normal exchanges cost otherwise
