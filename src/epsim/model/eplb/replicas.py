"""Redundant experts for the expert balancer (:mod:`epsim.model.eplb`): which experts get the
extra slots, and replicas of one expert moved onto distinct GPUs."""

from __future__ import annotations

import numpy as np

from .pack import compiled_loops


def replicate_experts(weights: np.ndarray, num_redundant: int, max_replicas: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Give the ``num_redundant`` extra slots to the experts with the most load per replica
    (one at a time, as DeepSeek's EPLB ``replicate_experts``).

    Args:
        weights: ``[rows, E]`` loads.
        num_redundant: extra slots ``R`` per row.
        max_replicas: at most this many replicas of one expert (the GPU count: more would put
            two on one GPU); ignored when the slots cannot be filled otherwise.

    Returns:
        ``phy2log`` ``[rows, E + R]`` (the first ``E`` are the experts themselves, then the
        replicas) and ``counts`` ``[rows, E]`` replicas per expert (>= 1).
    """
    rows, e = weights.shape
    if max_replicas is None or e * (max_replicas - 1) < num_redundant:
        max_replicas = num_redundant + 1
    loops = compiled_loops()
    if loops is not None:  # the same steps, one row at a time, compiled
        return loops.replicate_loop(np.ascontiguousarray(weights, dtype=np.float64),
                                    num_redundant, max_replicas)
    idx = np.arange(rows)
    phy2log = np.empty((rows, e + num_redundant), dtype=np.int64)
    phy2log[:, :e] = np.arange(e)
    counts = np.ones((rows, e), dtype=np.int64)
    for r in range(num_redundant):
        per_replica = np.where(counts < max_replicas, weights / counts, -np.inf)
        hottest = np.argmax(per_replica, axis=1)
        phy2log[:, e + r] = hottest
        counts[idx, hottest] += 1
    return phy2log, counts


def _spread_duplicates(item_w: np.ndarray, item_log: np.ndarray, groups: np.ndarray,
                       num_groups: int, max_rounds: int = 256) -> np.ndarray:
    """Move replicas of one expert that landed on the same GPU apart: swap one of them with the
    item of another GPU (not holding that expert) whose weight is closest, so the GPU loads
    barely change. Two replicas on one GPU are one slot wasted.

    Args / returns: ``[rows, n]`` item weights, logical experts and GPUs -> new GPUs.
    """
    rows, n = groups.shape
    groups = groups.copy()
    loops = compiled_loops()
    if loops is not None:  # the same rounds, one row at a time, compiled
        loops.spread_loop(np.ascontiguousarray(item_w, dtype=np.float64),
                          np.ascontiguousarray(item_log, dtype=np.int64), groups, num_groups,
                          max_rounds)
        return groups
    idx = np.arange(rows)
    for _ in range(max_rounds):
        # Step 1: per row, the first item sharing its GPU with another replica of its expert
        inc = np.zeros((rows, num_groups, int(item_log.max()) + 1), dtype=np.int64)
        np.add.at(inc, (idx[:, None], groups, item_log), 1)
        dup = inc[idx[:, None], groups, item_log] > 1
        r = np.flatnonzero(dup.any(axis=1))
        if len(r) == 0:
            break
        i = np.argmax(dup[r], axis=1)
        g, e = groups[r, i], item_log[r, i]
        # Step 2: partners j on a GPU without expert e, whose expert g does not hold
        ok = ((groups[r] != g[:, None]) & (inc[r[:, None], groups[r], e[:, None]] == 0)
              & (inc[r[:, None], g[:, None], item_log[r]] == 0))
        cost = np.where(ok, np.abs(item_w[r] - item_w[r, i][:, None]), np.inf)
        j = np.argmin(cost, axis=1)
        can = np.isfinite(cost[np.arange(len(r)), j])
        if not can.any():
            break
        r, i, j, g = r[can], i[can], j[can], g[can]
        groups[r, i] = groups[r, j]
        groups[r, j] = g
    return groups
