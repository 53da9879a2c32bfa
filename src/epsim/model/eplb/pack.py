"""Packers for the expert balancer (:mod:`epsim.model.eplb`): ``[rows, n]`` item weights and a
group count -> ``[rows, n]`` group ids, exactly ``n / num_groups`` items per group.

    greedy_groups   heaviest item first onto the lightest group with a free slot
    kk_groups       balanced largest differencing (Karmarkar-Karp with group sizes kept)
    exact_groups    every partition tried (at most ``EXACT_LIMIT``)
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import EpsimError


def compiled_loops() -> Any:
    """:mod:`epsim.model.eplb.kernels` where numba compiles it, else None (the numpy path
    runs). Imported on the first packing, so importing the balancer does not load numba."""
    from . import kernels

    return kernels if kernels.ENABLED else None


def greedy_groups(weights: np.ndarray, num_groups: int) -> np.ndarray:
    """Heaviest-first packing into groups of exactly ``n / num_groups`` items.

    Args:
        weights: ``[layers, n]`` non-negative item weights.
        num_groups: groups per layer; must divide ``n``.

    Returns:
        ``[layers, n]`` int64: the group of each item.
    """
    loops = compiled_loops()
    if loops is not None:  # the same steps, one layer at a time, compiled
        return loops.greedy_loop(np.ascontiguousarray(weights, dtype=np.float64), num_groups)
    layers, n = weights.shape
    size = n // num_groups
    rows = np.arange(layers)
    # Step 1: visit items heaviest first (stable, so ties keep expert order)
    order = np.argsort(-weights, axis=1, kind="stable")
    sorted_w = np.take_along_axis(weights, order, axis=1)
    # key: a group's load, or +inf once it is full
    key = np.zeros((layers, num_groups))
    fill = np.zeros((layers, num_groups), dtype=np.int64)
    chosen = np.empty((layers, n), dtype=np.int64)
    for step in range(n):
        # Step 2: the lightest group that still has room takes it (all layers at once)
        g = np.argmin(key, axis=1)
        chosen[:, step] = g
        key[rows, g] += sorted_w[:, step]
        fill[rows, g] += 1
        if step >= size - 1:  # no group can be full earlier
            full = fill[rows, g] == size
            if full.any():
                key[rows[full], g[full]] = np.inf
    groups = np.empty((layers, n), dtype=np.int64)
    np.put_along_axis(groups, order, chosen, axis=1)
    return groups


def kk_groups(weights: np.ndarray, num_groups: int) -> np.ndarray:
    """Balanced largest differencing (Karmarkar-Karp for ``k`` groups of equal size).

    The items, heaviest first, are cut into ``n / k`` consecutive chunks of ``k``; each chunk is
    a partial solution with one item per group. Repeatedly the two partial solutions with the
    largest spread (heaviest group minus lightest) are merged by pairing the heavier's groups,
    heaviest first, with the other's, lightest first, which cancels most of both spreads. Every
    merge adds one item of each chunk to every group, so group sizes stay exactly ``n / k``.

    Args:
        weights: ``[layers, n]`` non-negative item weights.
        num_groups: ``k``; must divide ``n``.

    Returns:
        ``[layers, n]`` int64: the group of each item.
    """
    layers, n = weights.shape
    k = num_groups
    m = n // k
    rows = np.arange(layers)
    # Step 1: chunks of k consecutive items in descending order; within a partial solution
    # the groups are kept sorted heaviest first, so "slot" j is the j-th heaviest group.
    order = np.argsort(-weights, axis=1, kind="stable")
    sums = np.take_along_axis(weights, order, axis=1).reshape(layers, m, k).copy()
    part = np.broadcast_to(np.arange(n) // k, (layers, n)).copy()  # per sorted position
    slot = np.broadcast_to(np.arange(n) % k, (layers, n)).copy()
    alive = np.ones((layers, m), dtype=bool)
    reverse = np.arange(k)[::-1]
    for _ in range(m - 1):
        # Step 2: the two live partial solutions with the largest spread, per layer
        spread = np.where(alive, sums[:, :, 0] - sums[:, :, -1], -np.inf)
        top2 = np.argpartition(-spread, 1, axis=1)[:, :2]
        a, b = top2[:, 0], top2[:, 1]
        # Step 3: heaviest of a with lightest of b, ...; then re-sort the merged groups
        merged = sums[rows, a] + sums[rows, b][:, reverse]
        resort = np.argsort(-merged, axis=1, kind="stable")  # new slot -> old slot of a
        rank = np.argsort(resort, axis=1)  # old slot of a -> new slot
        sums[rows, a] = np.take_along_axis(merged, resort, axis=1)
        alive[rows, b] = False
        # Step 4: relabel the items: b's slot j joined a's slot k-1-j; then a's re-sort
        in_b = part == b[:, None]
        slot = np.where(in_b, (k - 1) - slot, slot)
        in_ab = in_b | (part == a[:, None])
        part = np.where(in_b, a[:, None], part)
        slot = np.where(in_ab, np.take_along_axis(rank, slot, axis=1), slot)
    groups = np.empty((layers, n), dtype=np.int64)
    np.put_along_axis(groups, order, slot, axis=1)
    return groups


def members_of(groups: np.ndarray, num_groups: int) -> np.ndarray:
    """``[layers, n]`` group ids (exact sizes) -> ``[layers, num_groups, n / num_groups]`` items."""
    layers, n = groups.shape
    return np.argsort(groups, axis=1, kind="stable").reshape(layers, num_groups, n // num_groups)


#: enumerate every partition up to this many (a few ms); beyond, the heuristics
EXACT_LIMIT = 20_000


def partition_count(n: int, num_groups: int) -> int:
    """Ways to split ``n`` items into ``num_groups`` unlabelled groups of ``n / num_groups``."""
    s = n // num_groups
    return math.factorial(n) // (math.factorial(s) ** num_groups * math.factorial(num_groups))


@lru_cache(maxsize=16)
def _all_partitions(n: int, num_groups: int) -> np.ndarray:
    """``[P, n]`` group labels of every partition (item 0 always in group 0, the lowest
    unplaced item opens the next group, so each partition appears once)."""
    s = n // num_groups
    if s == 1:  # one item a group: the one partition (and no recursion num_groups deep)
        return np.arange(n, dtype=np.int64)[None, :]
    out: list[list[int]] = []
    labels = [-1] * n

    def place(group: int) -> None:
        if group == num_groups:
            out.append(labels.copy())
            return
        free = [i for i in range(n) if labels[i] < 0]
        for rest in itertools.combinations(free[1:], s - 1):
            for i in (free[0], *rest):
                labels[i] = group
            place(group + 1)
            for i in (free[0], *rest):
                labels[i] = -1

    place(0)
    return np.asarray(out, dtype=np.int64)


def exact_groups(weights: np.ndarray, num_groups: int) -> np.ndarray:
    """The optimum (lowest heaviest group) by trying every partition; small cases only.

    Args / returns: as :func:`greedy_groups`. Raises when there are more than
    ``EXACT_LIMIT`` partitions (e.g. 16 items in 4 groups)."""
    layers, n = weights.shape
    if partition_count(n, num_groups) > EXACT_LIMIT:
        raise EpsimError(f"exact balancing of {n} items in {num_groups} groups would try "
                         f"{partition_count(n, num_groups):,} partitions (limit {EXACT_LIMIT:,})")
    parts = _all_partitions(n, num_groups)  # [P, n]
    onehot = (parts[:, :, None] == np.arange(num_groups)).astype(np.float64)  # [P, n, k]
    sums = np.einsum("ln,pnk->lpk", weights, onehot)  # [layers, P, k]
    best = np.argmin(sums.max(axis=2), axis=1)
    return parts[best]
