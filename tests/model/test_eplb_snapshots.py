"""The ``minmax`` balancer: placement fitted to the worst of several load snapshots."""

import itertools
import json

import numpy as np
import pytest

from epsim.model import EpsimError
from epsim.model.eplb import balance_placement, balance_report
from epsim.model.eplb.balance import lower_bound
from epsim.model.eplb.pack import greedy_groups
from epsim.model.eplb.snapshots import refine_minmax, snapshot_weights
from epsim.model.loads import loads_from_object, read_loads
from epsim.model.placement import Placement


def test_snapshot_weights_give_every_snapshot_the_same_total():
    loads = np.array([[[1.0, 3.0], [0.0, 0.0]], [[30.0, 10.0], [0.0, 0.0]]])  # totals 4, 40
    w = snapshot_weights(loads)
    np.testing.assert_allclose(w[:, 0], [[5.5, 16.5], [16.5, 5.5]])  # both to 22
    assert not w[:, 1].any()  # a dense layer stays zero


def test_hand_example_without_replicas_mean_fit_hides_a_bad_partition():
    # 4 experts on 2 GPUs (2 each); the three partitions' GPU loads (totals 25, mean 12.5):
    #              {0,1|2,3}   {0,2|1,3}   {0,3|1,2}
    #   A            12|13       10|15       11|14
    #   B            12|13       15|10       12|13
    #   mean (A+B)/2 12|13     12.5|12.5   11.5|13.5
    #   C = 2B - A   12|13       20|5        13|12
    # the mean's best {0,2|1,3} is 1.2 on each snapshot; minmax takes {0,1|2,3} (1.04 on both)
    a, b = np.array([4.0, 8, 6, 7]), np.array([7.0, 5, 8, 5])
    c = 2 * b - a
    snaps = np.stack([a, b])[:, None, :]
    mm = balance_placement(snaps, 2, "minmax")
    mean_fit = balance_placement(snaps, 2, "greedy-swap")
    greedy = balance_placement(snaps, 2, "greedy")
    np.testing.assert_array_equal(mm.physical_to_logical, [[0, 1, 2, 3]])
    np.testing.assert_array_equal(mean_fit.physical_to_logical, [[0, 2, 1, 3]])
    np.testing.assert_array_equal(greedy.physical_to_logical, [[0, 2, 1, 3]])
    assert mm.imbalance(c[None])[0] == pytest.approx(13 / 12.5)
    assert mean_fit.imbalance(c[None])[0] == pytest.approx(20 / 12.5)
    assert greedy.imbalance(c[None])[0] == pytest.approx(20 / 12.5)
    # fitted: the worst snapshot, 1.04 against 1.2
    assert balance_report(snaps, 2, "minmax")[1]["imbalance_after"]["mean"] == pytest.approx(1.04)
    assert balance_report(snaps, 2)[1]["method"] == "minmax"  # the default with several


def test_hand_example_with_replicas_for_the_peak_not_the_mean():
    # 4 experts + 2 redundant slots on 2 GPUs (3 slots each), totals 29 (mean GPU 14.5).
    # Replicas go one at a time to the highest load per replica:
    #   minmax, peak over A and B [11, 7, 7, 8]: expert 0 (11 -> 5.5), then expert 3 (8)
    #   mean [11, 5.5, 6.5, 6]: expert 0 (11 -> 5.5), then expert 2 (6.5)
    # Two replicated experts sit on both GPUs, so the GPUs differ only by the other two:
    #   minmax [0 2 3 | 0 1 3] on C: 5.5 + 5 + 6 = 16.5 | 5.5 + 1 + 6 = 12.5 -> 16.5 / 14.5
    #   mean   [0 1 2 | 0 2 3] on C: 5.5 + 1 + 2.5 = 9  | 5.5 + 2.5 + 12 = 20  -> 20 / 14.5
    a, b = np.array([11.0, 7, 7, 4]), np.array([11.0, 4, 6, 8])
    c = 2 * b - a  # [11, 1, 5, 12]
    snaps = np.stack([a, b])[:, None, :]
    mm = balance_placement(snaps, 2, "minmax", redundant=2)
    mean_fit = balance_placement(snaps, 2, "greedy-swap", redundant=2)
    np.testing.assert_array_equal(mm.replica_counts, [[2, 1, 1, 2]])
    np.testing.assert_array_equal(mean_fit.replica_counts, [[2, 1, 2, 1]])
    np.testing.assert_array_equal(mm.physical_to_logical, [[0, 2, 3, 0, 1, 3]])
    np.testing.assert_array_equal(mean_fit.physical_to_logical, [[0, 1, 2, 0, 2, 3]])
    assert mm.imbalance(c[None])[0] == pytest.approx(16.5 / 14.5)
    assert mean_fit.imbalance(c[None])[0] == pytest.approx(20 / 14.5)
    # on A itself, a perfect fit: 5.5 + 7 + 2 on each GPU
    assert mm.imbalance(a[None])[0] == pytest.approx(1.0)


def brute_force_minmax(snaps, k):
    """Lowest heaviest group over every snapshot, trying every assignment of items."""
    s, n = snaps.shape[1] // k, snaps.shape[1]
    best = np.inf
    for labels in itertools.product(range(k), repeat=n):
        if np.bincount(labels, minlength=k).tolist() != [s] * k:
            continue
        sums = np.stack([np.bincount(labels, w, k) for w in snaps])
        best = min(best, sums.max())
    return best


@pytest.mark.parametrize("n, k, seed", [(6, 2, 0), (6, 3, 1), (8, 2, 2), (8, 4, 3)])
def test_small_cases_are_optimal_for_the_worst_snapshot(n, k, seed):
    rng = np.random.default_rng(seed)
    snaps = rng.integers(1, 50, size=(3, 1, n)).astype(float)
    snaps *= 100 / snaps.sum(axis=2, keepdims=True)  # equal totals: the weights are the loads
    p = balance_placement(snaps, k, "minmax")
    got = max(p.gpu_loads(x).max() for x in snaps)
    assert got == pytest.approx(brute_force_minmax(snaps[:, 0], k))


@pytest.mark.parametrize("experts, gpus, redundant, snaps, seed", [
    (64, 8, 0, 2, 0), (64, 8, 16, 3, 1), (48, 4, 8, 2, 2), (32, 8, 40, 2, 3), (16, 4, 4, 4, 4),
])
def test_properties(experts, gpus, redundant, snaps, seed):
    rng = np.random.default_rng(seed)
    loads = rng.pareto(1.5, size=(snaps, 5, experts)) * 100
    loads[:, 2] = 0  # a dense layer
    p = balance_placement(loads, gpus, "minmax", redundant=redundant)
    # every expert placed (Placement checks it), the same slots on every GPU, all slots used
    assert p.num_slots == experts + redundant and p.slots_per_gpu * gpus == p.num_slots
    assert (p.replica_counts.sum(axis=1) == experts + redundant).all()
    np.testing.assert_array_equal(p.physical_to_logical[2], np.arange(p.num_slots) % experts)
    # replicas of one expert on distinct GPUs (possible: no expert needs more than G)
    gpu = np.arange(p.num_slots) // p.slots_per_gpu
    for layer in range(5):
        pairs = set(zip(gpu, p.physical_to_logical[layer], strict=True))
        assert len(pairs) == p.num_slots
    # the worst snapshot is never worse than the heaviest-first start on the mean
    if redundant == 0:
        w = snapshot_weights(loads)[:, [0, 1, 3, 4]]
        start = greedy_groups(w.mean(axis=0), gpus)
        refined = refine_minmax(w, start, gpus)

        def peak(groups):
            return np.stack([[np.bincount(g, x, gpus).max() for g, x in zip(groups, s, strict=True)]
                             for s in w]).max(axis=0)
        assert (peak(refined) <= peak(start) + 1e-9).all()


def test_deterministic_and_layers_independent():
    rng = np.random.default_rng(7)
    loads = rng.pareto(1.2, size=(2, 6, 64)) * 50
    one = balance_placement(loads, 8, "minmax", redundant=8)
    two = balance_placement(loads.copy(), 8, "minmax", redundant=8)
    np.testing.assert_array_equal(one.physical_to_logical, two.physical_to_logical)
    # each layer is placed on its own: balancing layers apart gives the same rows
    apart = [balance_placement(loads[:, [i]], 8, "minmax", redundant=8).physical_to_logical[0]
             for i in range(6)]
    np.testing.assert_array_equal(one.physical_to_logical, np.stack(apart))


def test_one_snapshot_is_greedy_swap_exactly():
    loads = read_loads("prefill_in2048")
    for kw in ({}, {"redundant": 32}, {"nodes": 2, "expert_groups": 8}):
        ref = balance_placement(loads, 8, "greedy-swap", **kw).physical_to_logical
        for x in (loads, loads[None]):
            np.testing.assert_array_equal(balance_placement(x, 8, "minmax", **kw)
                                          .physical_to_logical, ref)
        np.testing.assert_array_equal(balance_placement(loads[None], 8, **kw)
                                      .physical_to_logical, ref)


def test_shipped_files_two_snapshots_hold_out_better_than_their_mean():
    names = ("decode_in1000out1000", "prefill_in2048")
    snaps = np.stack([read_loads(n) for n in names])
    mm = balance_placement(snaps, 8, "minmax")
    mean_fit = balance_placement(snaps, 8, "greedy-swap")
    rows = snaps[0].sum(axis=1) > 0
    # measured: 1.0519 vs 1.0530 on decode_in2000out100, 1.0322 vs 1.0703 on prefill_in4096
    for held, margin in (("decode_in2000out100", 0.0), ("prefill_in4096", 0.03)):
        loads = read_loads(held)
        assert mm.imbalance(loads)[rows].mean() < mean_fit.imbalance(loads)[rows].mean() - margin
    # and both snapshots stay fitted to within 0.1% (the mean fit: 4-7% on each)
    for x in snaps:
        assert mm.imbalance(x)[rows].mean() < 1.001 < mean_fit.imbalance(x)[rows].mean()


def test_hierarchical_snapshots_keep_routing_groups_whole():
    rng = np.random.default_rng(3)
    loads = rng.pareto(1.3, size=(2, 3, 64)) * 10
    p = balance_placement(loads, 8, "minmax", nodes=2, expert_groups=8, redundant=8)
    node = (np.arange(p.num_slots) // p.slots_per_gpu) // 4
    for layer in range(3):
        for group in range(8):
            on = set(node[(p.physical_to_logical[layer] // 8) == group])
            assert len(on) == 1


def test_snapshot_reports_and_errors():
    rng = np.random.default_rng(0)
    loads = rng.integers(1, 100, size=(3, 4, 16)).astype(float)
    placement, report = balance_report(loads, 4, eval_loads=loads[0])
    assert report["snapshots"] == 3 and report["method"] == "minmax"
    assert len(report["imbalance_after_per_snapshot"]) == 3
    worst = max(r["max"] for r in report["imbalance_after_per_snapshot"])
    assert report["imbalance_after"]["max"] == pytest.approx(worst)
    per = [lower_bound(x, 4)["max"] for x in loads]
    assert lower_bound(loads, 4)["max"] == pytest.approx(max(per))
    prev = Placement(np.tile(np.arange(16), (4, 1)), num_gpus=4, num_logical=16)
    with pytest.raises(EpsimError, match="one snapshot"):
        balance_placement(loads, 4, previous=prev, max_moves=2)
    with pytest.raises(EpsimError, match="snapshots"):
        balance_placement(np.ones((2, 2, 2, 2)), 2)


def test_load_windows_are_snapshots():
    obj = {"logical_count": [[[1, 2], [0, 0]], [[0, 0], [0, 0]], [[3, 1], [0, 0]]]}
    np.testing.assert_array_equal(loads_from_object(obj), [[4, 3], [0, 0]])  # summed
    from epsim.model.loads import _as_loads

    kept = _as_loads(obj, "x", windows=True)  # the idle window is dropped
    np.testing.assert_array_equal(kept, [[[1, 2], [0, 0]], [[3, 1], [0, 0]]])
    assert _as_loads({"logical_count": [[1, 2]]}, "x", windows=True).shape == (1, 1, 2)


def test_cli_several_load_files(epsim, tmp_path):
    r = epsim("balance", "--loads", "decode_in1000out1000,prefill_in2048", "--gpus", "8",
              "--eval", "prefill_in4096", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["snapshots"] == 2 and report["method"] == "minmax"
    assert report["imbalance_after"]["mean"] < 1.001
    assert report["eval"]["imbalance_after"]["mean"] < 1.04  # greedy-swap on the mean: 1.0703
    r = epsim("balance", "--loads", "decode_in1000out1000,prefill_in2048", "--gpus", "8")
    assert r.returncode == 0 and "snapshot 1 minmax" in r.stdout
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"logical_count": [[1] * 16] * 61}))
    r = epsim("balance", "--loads", f"prefill_in2048,{small}", "--gpus", "8")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "layers x experts" in r.stderr
