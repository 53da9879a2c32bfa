"""The fast paths of the balancer choose exactly what the plain search chose.

The minmax search runs in cache-sized blocks of rows (model/eplb/snapshots.py, _CACHE_FLOATS); blocks
are a speed choice only, so every placement must be the same whatever the block size, equal
to a plain every-pair search, and equal to the placements the one-block implementation gave
(golden hashes, recorded with it on tie-free inputs so that no sort's tie order enters)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epsim.model.eplb import balance_placement, snapshots
from epsim.model.eplb.snapshots import _MinmaxState


def _digest(p) -> str:
    return hashlib.sha256(p.physical_to_logical.astype(np.int64).tobytes()).hexdigest()[:16]


def _snapshots(seed: int, layers: int = 6, experts: int = 64, snaps: int = 2) -> np.ndarray:
    # continuous loads: no two items weigh the same, so no choice depends on a tie order
    return np.random.default_rng(seed).random((snaps, layers, experts)) * 1000 + 1


#: (method, redundant, snapshots) -> sha256[:16] of physical_to_logical, recorded with the
#: implementation before the blocked search (commit 2c17cae) on _snapshots(seed=3)
GOLDEN = {
    ("minmax", 0, 2): "5565d2e548b8bdbf",
    ("minmax", 32, 2): "db1281b58a4e02ce",
    ("minmax", 32, 3): "138a45c3f7f113cb",
    ("greedy-swap", 32, 1): "453abd3cb1bc7084",
    ("greedy-swap", 0, 1): "7c2588a75271cc9f",
}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_placements_match_the_previous_implementation(key):
    method, redundant, snaps = key
    loads = _snapshots(3, snaps=snaps)
    p = balance_placement(loads[0] if snaps == 1 else loads, 8, method, redundant=redundant)
    assert _digest(p) == GOLDEN[key]


@pytest.mark.parametrize("redundant", [0, 32])
def test_block_size_changes_no_placement(monkeypatch, redundant):
    loads = _snapshots(5, layers=9)
    ref = balance_placement(loads, 8, "minmax", redundant=redundant)
    for floats in (1, 5_000, 10**9):  # one row per block, a few rows, all rows at once
        monkeypatch.setattr(snapshots, "_CACHE_FLOATS", floats)
        p = balance_placement(loads, 8, "minmax", redundant=redundant)
        assert (p.physical_to_logical == ref.physical_to_logical).all()


def _brute_best(st_: _MinmaxState, row: int, a: int, partners: np.ndarray) -> tuple:
    """The lowest (after, i, b, j) over every allowed swap, one at a time (float32, as the
    search computes it)."""
    w32, s32 = st_.w.astype(np.float32), st_.sums.astype(np.float32)
    best = None
    s = st_.w.shape[3]
    for i in range(s):
        for b in partners:
            for j in range(s):
                if b == a:
                    continue
                if st_.log is not None and (st_.inc[row, b, st_.log[row, a, i]] > 0
                                            or st_.inc[row, a, st_.log[row, b, j]] > 0):
                    continue
                d = w32[:, row, a, i] - w32[:, row, b, j]
                after = np.maximum(s32[:, row, a] - d, d + s32[:, row, b]).max()
                if best is None or after < best[0]:
                    best = (after, i, b, j)
    return best


@pytest.mark.parametrize("with_log", [False, True])
def test_blocked_search_is_the_brute_force_minimum(with_log):
    rng = np.random.default_rng(11)
    snaps, layers, k, s = 2, 4, 4, 5
    n = k * s
    weights = rng.random((snaps, layers, n)) * 100
    groups = np.tile(np.repeat(np.arange(k), s), (layers, 1))
    for r in range(layers):
        rng.shuffle(groups[r])
    # with replicas: items 0..n-3 are experts, the last two replicate experts 0 and 1
    item_log = np.tile(np.r_[np.arange(n - 2), 0, 1], (layers, 1)) if with_log else None
    state = _MinmaxState.start(weights, groups, k, item_log)
    rows = np.arange(layers)
    a = np.argmax(state.peaks(rows), axis=1)
    partners = np.broadcast_to(np.arange(k), (layers, k))
    _, (i, j, b) = state.candidates(rows, a, partners)
    for r in range(layers):
        _, bi, bb, bj = _brute_best(state, r, a[r], partners[r])
        assert (i[r], b[r], j[r]) == (bi, bb, bj)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([(32, 8, 8), (64, 8, 32), (24, 4, 8), (16, 4, 0)]), st.integers(2, 3),
       st.integers(0, 2**31))
def test_minmax_replicas_conserve_load_and_place_every_expert(shape, snaps, seed):
    experts, gpus, redundant = shape
    rng = np.random.default_rng(seed)
    loads = np.floor(rng.pareto(1.2, size=(snaps, 3, experts)) * 50)
    loads[:, 0] = 0  # a dense layer
    p = balance_placement(loads, gpus, "minmax", redundant=redundant)
    counts = p.replica_counts
    # every expert has a slot, every slot an expert, every GPU the same number of slots
    assert counts.min() >= 1 and counts.sum(axis=1).tolist() == [experts + redundant] * 3
    assert p.num_slots == experts + redundant and p.num_slots % gpus == 0
    for x in loads:  # each snapshot's load is carried in full by the GPUs
        np.testing.assert_allclose(p.gpu_loads(x).sum(axis=1), x.sum(axis=1))
    per_gpu = p.physical_to_logical.reshape(3, gpus, p.slots_per_gpu)
    for layer in (1, 2):
        if counts[layer].max() <= gpus:
            for g in range(gpus):
                assert len(set(per_gpu[layer, g])) == p.slots_per_gpu
