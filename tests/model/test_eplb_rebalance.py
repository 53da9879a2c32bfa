"""Online rebalancing (bench/rebalance_study.py: a study, outside the package)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from epsim.model import EpsimError, load_model
from epsim.model.eplb import balance_placement
from epsim.model.loads import read_loads
from epsim.model.placement import Placement
from epsim.sim.hardware.profile import load_profile


def _load_study():
    """bench/rebalance_study.py, loaded by its path (bench/ is not a package)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "rebalance_study.py"
    spec = importlib.util.spec_from_file_location("rebalance_study", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


_study = _load_study()
LINK_EFFICIENCY = _study.LINK_EFFICIENCY
OnlineRebalancer = _study.OnlineRebalancer
RebalancePolicy = _study.RebalancePolicy
expert_weight_bytes = _study.expert_weight_bytes
load_stream = _study.load_stream
move_cost = _study.move_cost
sample_step_loads = _study.sample_step_loads
simulate_rebalancing = _study.simulate_rebalancing
transfer_matrix = _study.transfer_matrix
transfer_seconds = _study.transfer_seconds


def test_deepseek_expert_bytes():
    # 3 x 7168 x 2048 FP8 values plus one fp32 scale per 128x128 block
    assert expert_weight_bytes(load_model("deepseek-r1")) == pytest.approx(
        3 * 7168 * 2048 * (1 + 4 / 128**2))


def test_move_cost_by_hand():
    mi300x = load_profile("mi300x")
    # 2 GPUs x 2 slots: experts 1 and 2 trade places
    old = Placement(np.array([[0, 1, 2, 3]]), num_gpus=2, num_logical=4)
    new = Placement(np.array([[0, 2, 1, 3]]), num_gpus=2, num_logical=4)
    sent = transfer_matrix(old, new, 48e6)
    assert sent.tolist() == [[0.0, 48e6], [48e6, 0.0]]
    # full mesh: each direction has its own link at 64 GB/s x 0.75 = 48 GB/s -> 1 ms
    cost = move_cost(old, new, 48e6, mi300x)
    assert cost.experts == 2 and cost.bytes == 96e6
    assert cost.seconds == pytest.approx(48e6 / (64e9 * LINK_EFFICIENCY))
    # a switch: one GPU's port (18 links x 25 GB/s x 0.75) bounds it
    h100 = load_profile("h100")
    assert transfer_seconds(sent, h100) == pytest.approx(48e6 / (18 * 25e9 * LINK_EFFICIENCY))
    # across nodes (16 GPUs, 8 per node): GPU 0 sends 2 experts to GPU 8 over its 50 GB/s NIC
    cross = np.zeros((16, 16))
    cross[0, 8] = 2 * 44e6
    assert transfer_seconds(cross, mi300x) == pytest.approx(88e6 / 50e9)
    assert move_cost(old, old, 48e6, mi300x).seconds == 0.0


def test_sampled_step_loads():
    freqs = np.array([[0.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.25, 0.0]])
    step = sample_step_loads(freqs, 1000, np.random.default_rng(0))
    assert step[0].tolist() == [0, 0, 0, 0] and step[1].sum() == 1000 and step[1, 3] == 0
    steps = list(load_stream([(np.array([[1.0, 1.0]]), 3), (np.array([[1.0, 0.0]]), 2)], 10))
    assert len(steps) == 5 and steps[-1].tolist() == [[10.0, 0.0]]


def test_rebalancer_interval_window_and_min_gain():
    profile = load_profile("mi300x")
    skewed = np.array([[0.0] * 8, [10, 10, 10, 10, 1, 1, 1, 1.0]])
    start = balance_placement(np.ones((2, 8)), 2)  # contiguous-like: GPU 0 gets the hot half
    r = OnlineRebalancer(start, RebalancePolicy(interval_steps=3, window_steps=2), 1e6, profile)
    costs = [r.observe(skewed) for _ in range(6)]
    assert [c is not None for c in costs] == [False, False, True, False, False, False]
    assert len(r.window) == 2 and r.placement.imbalance(skewed)[1] == pytest.approx(1.0)
    assert costs[2].experts == 4 and costs[2].seconds > 0
    # already balanced: the second rebalance gains nothing and moves nothing
    lazy = OnlineRebalancer(r.placement, RebalancePolicy(3, 3, min_gain=0.01), 1e6, profile)
    assert [lazy.observe(skewed) for _ in range(3)] == [None, None, None]
    with pytest.raises(EpsimError, match="redundant"):
        OnlineRebalancer(start, RebalancePolicy(3, 3, redundant=2), 1e6, profile)
    with pytest.raises(EpsimError, match=">= 1 step"):
        RebalancePolicy(0, 3)


def test_online_rebalancing_follows_a_workload_shift():
    a = read_loads("decode_in2000out100")
    b = read_loads("decode_in1000out1000")
    initial = balance_placement(a, 8)
    policy = RebalancePolicy(interval_steps=10, window_steps=10, max_moves=16)
    run = simulate_rebalancing(load_stream([(a, 10), (b, 30)], 512 * 8 * 8, seed=3), initial,
                               policy, 44e6, load_profile("mi300x"))
    assert len(run.static_imbalance) == 40
    assert run.steps == [9, 19, 29, 39] and (run.move_seconds > 0).sum() == 4
    # after the shift (step 10) the first rebalance (end of step 19) restores the balance
    assert run.online_imbalance[20:].mean() < run.static_imbalance[20:].mean() - 0.02
    assert all(c.experts <= 16 * 58 for c in run.costs)
    summary = run.summary()
    assert summary["rebalances"] == 4 and summary["move_seconds_total"] > 0


def test_timed_rebalancing_charges_the_move_to_its_step():
    from rebalance_study import simulate_timed_rebalancing

    a = read_loads("prefill_in2048")
    b = read_loads("decode_in2000out100")

    def step_seconds(loads, placement, seed):
        # a stand-in for the per-step simulator: 10 ms times the placement's mean imbalance
        return 0.01 * float(np.mean(placement.imbalance(loads)[3:]))

    initial = balance_placement(a, 8)
    run = simulate_timed_rebalancing([(a, 5), (b, 10)], initial,
                                     RebalancePolicy(5, 5, max_moves=8), 44e6,
                                     load_profile("mi300x"), step_seconds, 4096 * 8)
    assert run.steps == [4, 9, 14]
    # the rebalancing steps pay the move on top; the others pay the placement's imbalance only
    moves = np.zeros(15)
    moves[run.steps] = [c.seconds for c in run.costs]
    np.testing.assert_allclose(run.move_seconds, moves)
    assert (run.online_step_s[[4, 9, 14]] > run.online_step_s[[3, 8, 13]]).all()
    # after the shift to decode at step 5 the step rebalanced at step 9 serves steps 10-14
    assert run.online_step_s[10:14].max() < run.static_step_s[10:14].min()
    s = run.summary()
    assert s["online_step_ms_max"] > s["online_step_ms_mean"] and s["static_step_ms_mean"] > 10


def test_online_eplb_through_the_step_simulator():
    from rebalance_study import simulate_online_eplb

    from epsim.model import make_plan
    from epsim.model.opgraph import Batch

    model = load_model("deepseek-r1")
    plan = make_plan(model, dp=8, ep=8)
    a = read_loads("prefill_in2048")
    b = read_loads("decode_in2000out100")
    run = simulate_online_eplb(model, plan, Batch.prefill(1, 2048), load_profile("mi300x"),
                               [(a, 3), (b, 6)], RebalancePolicy(3, 3, max_moves=16))
    assert run.steps == [2, 5, 8] and len(run.online_step_s) == 9
    assert (run.move_seconds[run.steps] > 0).all()
    # the first steps run the same placement: the same simulated time, plus the move at step 2
    np.testing.assert_allclose(run.online_step_s[:2], run.static_step_s[:2])
    assert run.online_step_s[2] == pytest.approx(run.static_step_s[2] + run.move_seconds[2])
    # once re-placed for the new workload (from step 6), steps are faster than the stale ones
    assert (run.online_step_s[6:8] < run.static_step_s[6:8]).all()
