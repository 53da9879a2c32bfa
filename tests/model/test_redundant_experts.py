"""Redundant experts in the plan: slots = experts + R, EP dividing the slots, replicas chosen by
the balancer, routing through the replicas (tokens conserved), memory and graph counting slots,
and the command line (describe's slots per GPU, step's acceptance plan, balance's alias)."""

import json

import numpy as np
import pytest

from epsim.cli import main
from epsim.model import Batch, accounting, load_model, make_plan
from epsim.model.errors import EpsimError
from epsim.model.graph import build_step_graph
from epsim.model.placement import Placement, contiguous_placement, remap
from epsim.sim.hardware.profile import load_profile
from epsim.sim.step.routing import sample_routing, slot_frequencies
from epsim.sim.step.simulate import simulate_step

V3 = load_model("deepseek-v3")
TINY = load_model("tiny-deepseek")


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def test_ep_may_divide_the_slots_and_not_the_experts():
    # SGLang's EP72: 256 + 32 = 288 slots, 4 per GPU
    plan = make_plan(V3, nodes=9, dp=72, ep=72, redundant_experts=32)
    assert plan.expert_slots(V3) == 288 and plan.slots_per_gpu(V3) == 4
    with pytest.raises(EpsimError, match="ep 72 does not divide the 256 experts of deepseek-v3"):
        make_plan(V3, nodes=9, dp=72, ep=72)
    with pytest.raises(EpsimError, match=r"ep 72 does not divide the 256 experts \+ 30 "
                                         r"redundant = 286 expert slots of deepseek-v3"):
        make_plan(V3, nodes=9, dp=72, ep=72, redundant_experts=30)


def test_replicas_need_expert_parallelism_and_a_count():
    with pytest.raises(EpsimError, match="with ep 1 every GPU holds every expert"):
        make_plan(V3, tp=8, ep=1, redundant_experts=8)
    with pytest.raises(EpsimError, match="non-negative integer"):
        make_plan(V3, redundant_experts=-1)


def test_refusing_a_plan_that_divides_neither_is_one_line_exit_2(capsys):
    code, _, err = run(capsys, "step", "--model", "deepseek-v3", "--hardware", "h100",
                       "--nodes", "9", "--dp", "72", "--ep", "72", "--redundant-experts", "30",
                       "--batch", "8", "--context", "100")
    assert code == 2
    assert err == ("epsim step: error: ep 72 does not divide the 256 experts + 30 redundant = "
                   "286 expert slots of deepseek-v3\n")


# --------------------------------------------------------------------------------------------
# Memory and the graph count slots
# --------------------------------------------------------------------------------------------


def test_memory_counts_the_replicas_weights():
    # tiny-deepseek: an expert is 3 x 64 x 32 bf16 = 12,288 bytes; 2 MoE layers; 2 GPUs
    plain = accounting.weight_bytes_per_rank(TINY, make_plan(TINY, gpus_per_node=2))
    with_r = accounting.weight_bytes_per_rank(
        TINY, make_plan(TINY, gpus_per_node=2, redundant_experts=2))
    assert plain["routed_experts"] == 8 * 2 * 12_288
    assert with_r["routed_experts"] == 9 * 2 * 12_288  # 18 slots, 9 per GPU
    assert with_r["total"] - plain["total"] == 2 * 12_288
    # DeepSeek-V3 EP72 + 32: 4 slots x 58 layers x (3 x 7168 x 2048 FP8 + a scale per 128x128)
    v3 = accounting.weight_bytes_per_rank(V3, make_plan(V3, nodes=9, redundant_experts=32))
    assert v3["routed_experts"] == 4 * 58 * (44_040_192 + 44_040_192 // 4096)


def test_graph_experts_are_the_ranks_slots():
    plan = make_plan(V3, nodes=9, dp=72, ep=72, redundant_experts=32)
    graph = build_step_graph(V3, plan, Batch.decode(256, 2000))
    op = graph.ops["L3.moe.experts.mb0"]
    assert op.dims["experts"] == 4
    # 128 tokens per microbatch from each of 72 ranks, top-8 over 288 slots (uniform)
    active = 4 * (1 - (1 - 8 / 288) ** (128 * 72))
    assert op.dims["active_experts"] == pytest.approx(active)
    per_expert = 3 * 7168 * 2048 * (1 + 1 / 4096)
    assert op.weight_bytes == pytest.approx(active * per_expert)
    # the router still scores the 256 logical experts
    assert graph.ops["L3.moe.router.mb0"].dims["experts"] == 256


# --------------------------------------------------------------------------------------------
# Routing through replicas
# --------------------------------------------------------------------------------------------


def test_remap_sends_every_pair_to_exactly_one_replica_of_its_expert():
    # 4 experts, 2 GPUs x 3 slots: expert 0 in slots 0 and 3, expert 1 in slots 1 and 4
    p = Placement(np.array([[0, 1, 2, 0, 1, 3]]), num_gpus=2, num_logical=4)
    ids = np.array([[0, 1], [1, 0], [0, 2], [1, 3]])  # 4 tokens, top-2
    slots = remap(ids, p.logical_to_physical[0], p.replica_counts[0], np.arange(4)[:, None])
    # flattened positions 0..7, replica = position % 2 for experts 0 and 1:
    # (0: e0 r0) (1: e1 r1) (2: e1 r0) (3: e0 r1) (4: e0 r0) (5: e2) (6: e1 r0) (7: e3)
    assert slots.tolist() == [[0, 4], [1, 3], [0, 2], [1, 5]]
    assert (p.physical_to_logical[0][slots] == ids).all()  # each lands on its own expert
    # every pair is counted once: 8 pairs over the 6 slots; expert 0's 3 pairs split 2 + 1,
    # expert 1's 3 pairs 2 + 1
    assert np.bincount(slots.ravel(), minlength=6).tolist() == [2, 2, 1, 1, 1, 1]


def test_sampled_routing_conserves_pairs_over_the_replicas():
    plan = make_plan(TINY, gpus_per_node=2, redundant_experts=2)
    placement = Placement(np.tile(np.r_[np.arange(8), 5, np.arange(8, 16), 0], (3, 1)),
                          num_gpus=2, num_logical=16)
    loads = np.zeros((3, 16))
    loads[1:] = np.arange(1, 17)
    rng = np.random.default_rng(0)
    s = sample_routing(TINY, loads, placement, (6, 5), plan.world_size, rng)
    # every microbatch's tokens x top-4 pairs of both ranks land on exactly one slot
    assert s.slot_pairs.sum(axis=-1).tolist() == [[48, 40], [48, 40]]
    assert (s.pairs.sum(axis=(2, 3)) == s.slot_pairs.sum(axis=-1)).all()
    # the replicas of expert 5 (slots 5 and 8) and of expert 0 (slots 0 and 17) each get half
    # their expert's frequency
    freqs = loads[1:] / loads[1:].sum(axis=1, keepdims=True)
    p = slot_frequencies(freqs, placement, np.array([1, 2]))
    assert p[0, 5] == pytest.approx(freqs[0, 5] / 2) and p[0, 8] == pytest.approx(freqs[0, 5] / 2)
    assert p[0, 0] == pytest.approx(freqs[0, 0] / 2) and p[0, 17] == pytest.approx(freqs[0, 0] / 2)
    assert p.sum(axis=1) == pytest.approx([1.0, 1.0])


def test_step_balances_replicas_from_the_loads():
    h100 = load_profile("h100", kernels="none")
    plan = make_plan(V3, nodes=9, gpus_per_node=8, dp=72, ep=72, redundant_experts=32)
    r = simulate_step(V3, plan, Batch.decode(64, 2000), h100)
    assert r.step_ms > 0 and 1.0 <= r.expert_imbalance < 1.2
    # the contiguous layout with the replica slots wrapping round (experts 0..31 twice)
    flat = simulate_step(V3, plan, Batch.decode(64, 2000), h100, eplb=False)
    assert flat.expert_imbalance > r.expert_imbalance
    wrong = contiguous_placement(61, 256, 72, redundant=104)  # 360 slots, 5 per GPU
    with pytest.raises(EpsimError, match="360 expert slots, the plan 288"):
        simulate_step(V3, plan, Batch.decode(64, 2000), h100, placement=wrong)


def test_contiguous_placement_wraps_the_redundant_slots():
    p = contiguous_placement(1, 4, 3, redundant=2)
    assert p.physical_to_logical.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert p.slots_per_gpu == 2 and p.replica_counts.tolist() == [[2, 2, 1, 1]]
    with pytest.raises(EpsimError, match="3 GPUs do not divide 4 experts \\+ 1 redundant"):
        contiguous_placement(1, 4, 3, redundant=1)


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------

EP72 = ("--model", "deepseek-v3", "--hardware", "h100", "--nodes", "9", "--dp", "72", "--ep",
        "72", "--redundant-experts", "32")


def test_describe_shows_four_slots_per_gpu(capsys):
    code, out, _ = run(capsys, "describe", *EP72, "--json")
    assert code == 0
    plan = json.loads(out)["plan"]
    assert (plan["slots_per_gpu"], plan["expert_slots"], plan["redundant_experts"]) == (4, 288, 32)
    code, out, _ = run(capsys, "describe", *EP72)
    assert code == 0 and "ep 72 (4 slots/GPU: 256 experts + 32 redundant)" in out


def test_the_published_ep72_decode_step_runs(capsys):
    code, out, err = run(capsys, "step", *EP72, "--batch", "256", "--context", "2000",
                         "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["plan"]["slots_per_gpu"] == 4 and d["plan"]["redundant_experts"] == 32
    assert d["step_ms"] > 0 and len(d["rank_ms"]) == 72


def test_predict_echoes_the_redundant_slots(capsys):
    code, out, err = run(capsys, "predict", *EP72, "--kernels", "none", "--concurrency", "144",
                         "--isl", "100", "--osl", "4", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert (d["redundant_experts"], d["slots_per_gpu"], d["ep"]) == (32, 4, 72)


def test_balance_redundant_is_an_alias_and_ep72_balances(capsys):
    outs = []
    for flag in ("--redundant-experts", "--redundant"):
        code, out, _ = run(capsys, "balance", "--loads", "decode_in2000out100", "--gpus", "72",
                           flag, "32", "--json")
        assert code == 0
        d = json.loads(out)
        d.pop("wall_ms")
        outs.append(d)
    assert outs[0] == outs[1]
    assert outs[0]["slots_per_gpu"] == 4
    assert outs[0]["imbalance_after"]["mean"] < outs[0]["imbalance_before"]["mean"]


# --------------------------------------------------------------------------------------------
# The runtime's options (the runs themselves: tests/runtime/test_runtime_ep.py, test_runtime_cli.py)
# --------------------------------------------------------------------------------------------


def test_runtime_takes_the_redundant_slots_from_the_placement(tmp_path):
    from epsim.runtime.options import RunOptions, validate

    base = RunOptions(model="tiny-deepseek", world_size=2, batch=2, context=4, steps=1)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(contiguous_placement(3, 16, 2, redundant=2).to_json()))
    _, plan, placement = validate(base.with_(placement=str(path)))
    assert plan.redundant_experts == 2 and placement.slots_per_gpu == 9
    # the graph holds the same 9 experts per rank as the placement
    graph = build_step_graph(TINY, plan, Batch.decode(2, 4))
    assert graph.ops["L1.moe.experts.mb0"].dims["experts"] == 9
    with pytest.raises(EpsimError, match="18 slots = 16 experts \\+ 2 redundant, but redundant "
                                         "experts is 4"):
        validate(base.with_(placement=str(path), redundant_experts=4))
    table = tuple(tuple(row) for row in contiguous_placement(3, 16, 2, 2).physical_to_logical)
    with pytest.raises(EpsimError, match="not both"):
        validate(base.with_(placement=str(path), placement_table=table))
    _, plan, placement = validate(base.with_(redundant_experts=2))  # contiguous, wrapping
    assert placement.physical_to_logical[0].tolist() == [*range(16), 0, 1]
