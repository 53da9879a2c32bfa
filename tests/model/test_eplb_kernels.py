"""The compiled balancer loops (model/eplb/kernels.py) choose exactly what the numpy path
chooses, ties included: integer loads with many equal items, replicas (equal weights, the
no-two-on-a-GPU rule), one to three snapshots."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epsim.model.eplb import balance_placement, kernels
from epsim.model.eplb.pack import greedy_groups

pytestmark = pytest.mark.skipif(not kernels.ENABLED, reason="numba not installed")


def _both(monkeypatch, fn):
    compiled = fn()
    monkeypatch.setattr(kernels, "ENABLED", False)
    try:
        numpy_path = fn()
    finally:
        monkeypatch.setattr(kernels, "ENABLED", True)
    return compiled, numpy_path


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(64, 8, 0), (64, 8, 32), (64, 8, 8), (32, 4, 8), (48, 8, 16)]),
       st.sampled_from(["greedy-swap", "greedy-swap2", "kk-swap", "minmax"]),
       st.integers(1, 3), st.sampled_from([3, 20, 1000]), st.integers(0, 2**31))
def test_compiled_loops_place_as_the_numpy_path(shape, method, snaps, top, seed):
    experts, gpus, redundant = shape
    rng = np.random.default_rng(seed)
    # small integer loads: many items weigh the same, so every tie rule is exercised
    loads = np.floor(rng.pareto(1.2, size=(snaps, 4, experts)) * top / 10) + rng.integers(
        0, 2, size=(snaps, 4, experts))
    loads[:, 0] = 0  # a dense layer
    x = loads[0] if snaps == 1 else loads
    with pytest.MonkeyPatch.context() as mp:
        a, b = _both(mp, lambda: balance_placement(x, gpus, method, redundant=redundant))
    assert (a.physical_to_logical == b.physical_to_logical).all()


def test_compiled_loops_on_the_shipped_files(monkeypatch):
    from epsim.model.loads import moe_layer_rows, read_loads, shipped_loads

    files = [read_loads(n) for n in shipped_loads()[:2]]
    rows = moe_layer_rows(files[0])
    for x in (files[0][rows], np.stack([f[rows] for f in files])):
        for redundant in (0, 32):
            a, b = _both(monkeypatch, lambda x=x, r=redundant: balance_placement(
                x, 8, redundant=r))
            assert (a.physical_to_logical == b.physical_to_logical).all()


def test_greedy_loop_is_greedy_groups(monkeypatch):
    # heaviest first onto the lightest group with room; equal weights in index order
    w = np.array([[5.0, 1.0, 5.0, 3.0, 3.0, 0.0]])
    a, b = _both(monkeypatch, lambda: greedy_groups(w, 2))
    # 5 (item 0) -> g0, 5 (item 2) -> g1, 3 (item 3) -> g0 (tie: first), 3 (item 4) -> g1,
    # 1 -> g0 (full now), 0 -> g1
    assert a.tolist() == b.tolist() == [[0, 0, 1, 0, 1, 1]]


@pytest.mark.parametrize("n", [6, 36, 630])  # insertion sort, and quicksort + runs fixed
def test_stable_argsort_keeps_equal_keys_in_index_order(n):
    x = np.resize([2.0, 1.0, 2.0, -0.0, 0.0, 1.0, 7.5], n)
    x[::5] = np.arange(len(x[::5]))  # long runs of equal keys and single ones
    assert kernels._stable_argsort(x).tolist() == np.argsort(x, kind="stable").tolist()
