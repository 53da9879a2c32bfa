import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epsim.model import EpsimError
from epsim.model.eplb import BALANCERS, balance_placement, default_placement, moved_experts
from epsim.model.eplb.balance import lower_bound
from epsim.model.eplb.pack import exact_groups, greedy_groups, kk_groups, partition_count
from epsim.model.eplb.replicas import replicate_experts
from epsim.model.eplb.swaps import refine_swaps
from epsim.model.loads import read_loads, shipped_loads
from epsim.model.placement import contiguous_placement, remap

HEURISTICS = ("greedy", "kk", "kk-swap", "greedy-swap", "greedy-swap2")


def brute_force_best(w, k):
    """Lowest possible heaviest group, by recursion over which items join the first free item."""
    s = len(w) // k
    best = np.inf

    def rec(rest, heaviest):
        nonlocal best
        if heaviest >= best:
            return
        if not rest:
            best = heaviest
            return
        for comb in itertools.combinations(rest[1:], s - 1):
            group = (rest[0], *comb)
            rec([i for i in rest if i not in group], max(heaviest, sum(w[i] for i in group)))

    rec(list(range(len(w))), 0.0)
    return best


def group_max(w, groups, k):
    return np.bincount(groups, weights=w, minlength=k).max()


def test_partition_count_by_hand():
    assert partition_count(4, 2) == 3  # {01|23, 02|13, 03|12}
    assert partition_count(6, 3) == 15
    assert partition_count(8, 2) == 35


def test_kk_hand_example():
    # chunks (8,7) (6,5) (4,3) (2,1), spreads 1 each: (8,7)+(5,6)=(13,13), ... -> 18 / 18
    w = np.array([[8.0, 7, 6, 5, 4, 3, 2, 1]])
    g = kk_groups(w, 2)[0]
    assert np.bincount(g, weights=w[0]).tolist() == [18.0, 18.0]
    assert np.bincount(g).tolist() == [4, 4]


@pytest.mark.parametrize("n, k", [(8, 2), (9, 3), (12, 3), (12, 4), (10, 5)])
def test_default_and_exact_are_optimal_on_small_cases(n, k):
    rng = np.random.default_rng(n * 10 + k)
    w = rng.integers(1, 100, size=(12, n)).astype(float)
    for method in ("greedy-swap", "greedy-swap2", "kk-swap", "exact"):
        groups = BALANCERS[method](w, k)
        for row, g in zip(w, groups, strict=True):
            assert np.bincount(g, minlength=k).tolist() == [n // k] * k
            assert group_max(row, g, k) == brute_force_best(row, k), method


def test_exact_refuses_large_instances():
    with pytest.raises(EpsimError, match="partitions"):
        exact_groups(np.ones((1, 32)), 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(4, 10), st.integers(1, 3), st.integers(0, 2**31))
def test_every_packer_keeps_group_sizes_and_swaps_never_hurt(k, s, layers, seed):
    rng = np.random.default_rng(seed)
    n = k * s
    # skewed loads like the real ones: a few hot experts
    w = np.floor(rng.pareto(1.5, size=(layers, n)) * 100)
    for method in HEURISTICS:
        groups = BALANCERS[method](w, k)
        for g in groups:
            assert np.bincount(g, minlength=k).tolist() == [s] * k, method
    start = greedy_groups(w, k)
    for exchange in (False, True):
        refined = refine_swaps(w, start, k, exchange=exchange)
        for row, a, b in zip(w, start, refined, strict=True):
            assert np.bincount(b, minlength=k).tolist() == [s] * k
            assert group_max(row, b, k) <= group_max(row, a, k) + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(16, 4), (24, 4), (32, 8), (12, 3), (16, 8)]), st.integers(0, 2),
       st.integers(0, 2**31), st.booleans())
def test_placements_are_valid_assignments(shape, multiple, seed, two_nodes):
    experts, gpus = shape
    nodes = 2 if two_nodes and gpus % 2 == 0 else 1
    redundant = gpus * multiple  # divisible by the GPUs and so by the nodes
    rng = np.random.default_rng(seed)
    loads = np.floor(rng.pareto(1.2, size=(3, experts)) * 50)
    loads[0] = 0  # a dense layer
    p = balance_placement(loads, gpus, redundant=redundant, nodes=nodes)
    assert p.num_slots == experts + redundant
    counts = p.replica_counts
    assert counts.min() >= 1 and counts.sum(axis=1).tolist() == [experts + redundant] * 3
    # loads are conserved, and no GPU holds one expert twice while fewer replicas than GPUs
    # per node would do
    np.testing.assert_allclose(p.gpu_loads(loads).sum(axis=1), loads.sum(axis=1))
    per_gpu = p.physical_to_logical.reshape(3, gpus, p.slots_per_gpu)
    for layer in (1, 2):
        if counts[layer].max() <= gpus // nodes:
            for g in range(gpus):
                assert len(set(per_gpu[layer, g])) == p.slots_per_gpu
    # the contiguous layout for the dense layer
    assert (p.physical_to_logical[0][:experts] == np.arange(experts)).all()


def test_remap_sends_every_token_to_a_gpu_holding_its_expert():
    rng = np.random.default_rng(0)
    loads = np.floor(rng.pareto(1.2, size=(4, 64)) * 100) + 1
    p = balance_placement(loads, 8, redundant=16)
    l2p = p.logical_to_physical
    for layer in range(4):
        ids = np.stack([rng.choice(64, size=6, replace=False) for _ in range(500)])
        slots = remap(ids, l2p[layer], p.replica_counts[layer], np.arange(500)[:, None])
        assert (p.physical_to_logical[layer][slots] == ids).all()
        gpus = p.gpu_of_slot(slots)
        holds = p.physical_to_logical[layer].reshape(8, -1)
        assert all(ids[t, j] in holds[gpus[t, j]] for t in range(500) for j in range(6))
    # replicas share an expert's tokens evenly (round robin over the token index)
    hot = int(np.argmax(p.replica_counts[1]))
    r = int(p.replica_counts[1, hot])
    assert r > 1
    ids = np.full((40 * r, 1), hot)
    slots = remap(ids, l2p[1], p.replica_counts[1], np.arange(40 * r)[:, None])
    assert sorted(np.bincount(slots.ravel()).tolist()) == [0] * (slots.max() + 1 - r) + [40] * r


def test_remap_on_torch_matches_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    loads = rng.integers(1, 1000, size=(1, 32)).astype(float)
    p = balance_placement(loads, 4, redundant=8)
    ids = np.stack([rng.choice(32, size=4, replace=False) for _ in range(50)])
    token = np.arange(50)[:, None]
    want = remap(ids, p.logical_to_physical[0], p.replica_counts[0], token)
    got = remap(torch.from_numpy(ids), torch.from_numpy(p.logical_to_physical[0]),
                torch.from_numpy(p.replica_counts[0]), torch.from_numpy(token))
    assert got.tolist() == want.tolist()


def test_replicate_experts_hottest_per_replica_first():
    phy, counts = replicate_experts(np.array([[90.0, 40.0, 10.0]]), 3)
    # 90 -> 2 replicas (45 each), then 45 > 40 -> 3 replicas (30), then 40 > 30 -> expert 1
    assert phy.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert counts.tolist() == [[3, 2, 1]]
    _, capped = replicate_experts(np.array([[90.0, 40.0, 10.0]]), 3, max_replicas=2)
    assert capped.tolist() == [[2, 2, 2]]


@pytest.fixture(scope="module")
def shared(request):
    return {name: read_loads(name) for name in shipped_loads()}


def test_shared_files_meet_the_targets(shared):
    assert len(shared) == 4
    for name, loads in shared.items():
        moe = slice(3, None)
        epsim = balance_placement(loads, 8).imbalance(loads)[moe]
        greedy = balance_placement(loads, 8, method="greedy").imbalance(loads)[moe]
        assert epsim.mean() <= 1.0001 and epsim.max() <= 1.0005, name
        assert epsim.mean() < greedy.mean() and epsim.max() < greedy.max(), name
        assert lower_bound(loads, 8)["max"] <= epsim.max()
        replicated = balance_placement(loads, 8, redundant=32)
        assert replicated.slots_per_gpu == 36
        assert replicated.imbalance(loads)[moe].mean() < epsim.mean(), name


def test_held_out_no_worse_than_greedy(shared):
    pairs = [("decode_in1000out1000", "decode_in2000out100"),
             ("prefill_in2048", "prefill_in4096")]
    ours, theirs = [], []
    for a, b in pairs:
        for fit, held in ((a, b), (b, a)):
            ours.append(balance_placement(shared[fit], 8).imbalance(shared[held])[3:].mean())
            theirs.append(balance_placement(shared[fit], 8, method="greedy")
                          .imbalance(shared[held])[3:].mean())
    assert np.mean(ours) <= np.mean(theirs)


def test_previous_placement_moves_and_budget(shared):
    old_loads, new_loads = shared["decode_in2000out100"], shared["decode_in1000out1000"]
    old = balance_placement(old_loads, 8)
    fresh = balance_placement(new_loads, 8)
    matched = balance_placement(new_loads, 8, previous=old)
    # renumbering GPUs keeps the loads and moves fewer experts
    np.testing.assert_allclose(matched.imbalance(new_loads)[3:], fresh.imbalance(new_loads)[3:])
    assert moved_experts(old, matched).sum() < moved_experts(old, fresh).sum()
    stale = old.imbalance(new_loads)[3:].mean()
    last = stale
    for budget in (0, 4, 16):
        p = balance_placement(new_loads, 8, previous=old, max_moves=budget)
        moved = moved_experts(old, p)
        assert moved.max() <= budget
        now = p.imbalance(new_loads)[3:].mean()
        assert now <= last + 1e-12
        last = now
    assert last < stale


def test_hierarchical_keeps_routing_groups_on_one_node():
    rng = np.random.default_rng(3)
    loads = np.floor(rng.pareto(1.2, size=(2, 64)) * 100) + 1
    p = balance_placement(loads, 8, nodes=2, expert_groups=8, redundant=8)
    node_of_slot = np.arange(p.num_slots) // (p.num_slots // 2)
    for layer in range(2):
        for group in range(8):
            members = np.arange(group * 8, group * 8 + 8)
            nodes = {int(node_of_slot[s]) for s in range(p.num_slots)
                     if p.physical_to_logical[layer, s] in members}
            assert len(nodes) == 1
    flat = balance_placement(loads, 8, nodes=2)
    assert flat.imbalance(loads).max() < contiguous_placement(2, 64, 8).imbalance(loads).max()


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=3), "do not divide"),
    (dict(num_gpus=4, redundant=2), "do not divide"),
    (dict(num_gpus=4, nodes=3), "nodes must divide"),
    (dict(num_gpus=4, nodes=2, expert_groups=3), "expert groups"),
    (dict(num_gpus=4, method="magic"), "unknown balancer"),
    (dict(num_gpus=4, max_moves=3), "previous placement"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(EpsimError, match=message):
        balance_placement(np.ones((2, 16)), **kwargs)


def test_previous_placement_matching_keeps_the_node_split():
    rng = np.random.default_rng(5)
    old_loads, new_loads = (np.floor(rng.pareto(1.2, size=(3, 64)) * 100) + 1 for _ in range(2))
    kw = dict(nodes=2, expert_groups=8, redundant=8)
    old = balance_placement(old_loads, 8, **kw)
    fresh = balance_placement(new_loads, 8, **kw)
    matched = balance_placement(new_loads, 8, previous=old, **kw)
    np.testing.assert_allclose(matched.imbalance(new_loads), fresh.imbalance(new_loads))
    assert moved_experts(old, matched).sum() <= moved_experts(old, fresh).sum()
    # every node holds the same experts as in the fresh placement, only GPU numbers changed
    half = matched.num_slots // 2
    for layer in range(3):
        for node in (0, 1):
            part = slice(node * half, (node + 1) * half)
            assert sorted(matched.physical_to_logical[layer, part]) == \
                sorted(fresh.physical_to_logical[layer, part])


def test_default_placement_is_the_balancer_or_the_contiguous_layout():
    rng = np.random.default_rng(11)
    loads = np.floor(rng.pareto(1.2, size=(4, 32)) * 100) + 1
    loads[0] = 0  # a dense layer
    for redundant in (0, 8):
        balanced = default_placement(loads, 4, balanced=True, redundant=redundant)
        np.testing.assert_array_equal(
            balanced.physical_to_logical,
            balance_placement(loads, 4, redundant=redundant).physical_to_logical)
        plain = default_placement(loads, 4, balanced=False, redundant=redundant)
        np.testing.assert_array_equal(plain.physical_to_logical,
                                      contiguous_placement(4, 32, 4, redundant).physical_to_logical)


def test_one_item_per_group_is_the_identity_at_any_width():
    # 2,048 groups of one: a single partition, found without a recursion 2,048 deep
    w = np.arange(2048, dtype=np.float64)[None, :]
    assert partition_count(2048, 2048) == 1
    assert (exact_groups(w, 2048) == np.arange(2048)).all()
