"""Placement for several load snapshots: fit the worst snapshot, not their average.

A placement fitted to one load file meets the next workload's loads, and on the shipped
DeepSeek-V3 files the shift costs 3-15% imbalance whatever near-optimal partition was chosen
(docs/placement.md, "Placement for the workload to come"). What carries over is the direction in
which workloads differ: a placement balanced on *each* of several snapshots at once balances
every mixture of them and, on the shipped files, the next workload better than a placement
fitted to their average.

``minmax`` (:data:`SNAPSHOT_BALANCERS`) takes ``[snapshots, layers, experts]`` loads, scales
every snapshot's layer to the same total (each snapshot counts the same, whatever its token
count) and minimises, per layer, the heaviest GPU over all snapshots:

1. replicas (redundant slots) go to the experts with the highest *peak* load per replica over
   the snapshots, so an expert that is hot in one snapshot only gets a replica too
   (:func:`replicate_experts` on the per-expert maximum);
2. the items start from the heaviest-first packing of the snapshots' mean;
3. :func:`refine_minmax` swaps items between GPUs while a swap lowers the pair's heavier GPU
   load in its worst snapshot (the snapshot-vector version of :func:`refine_swaps`).

With one snapshot there is nothing to hedge: ``minmax`` is ``greedy-swap`` exactly (same code,
same result, same speed; :mod:`epsim.model.eplb` routes it there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pack import (
    EXACT_LIMIT,
    _all_partitions,
    compiled_loops,
    greedy_groups,
    members_of,
    partition_count,
)
from .replicas import _spread_duplicates, replicate_experts
from .swaps import _NO_LOG, move_log_counts, swap_round

#: float32 elements of one block of the minmax search (256 KiB: the arrays of a block stay in
#: a core's L2 cache; a tuning constant, it changes no result)
_CACHE_FLOATS = 65_536


def snapshot_weights(loads: np.ndarray) -> np.ndarray:
    """``[S, layers, E]`` counts -> the same with each snapshot's layer scaled to the snapshots'
    mean total for that layer, so every snapshot weighs the same. Example: totals 100 and 300
    in a layer both become 200. Layers without load stay zero."""
    totals = loads.sum(axis=2, keepdims=True)
    target = totals.mean(axis=0, keepdims=True)
    return np.divide(loads * target, totals, out=np.zeros_like(loads), where=totals > 0)


@dataclass
class _MinmaxState:
    """Mutable state of :func:`refine_minmax` (rows = layers, k groups of s items, S snapshots).

    mem: ``[rows, k, s]`` item ids per group.  w: ``[S, rows, k, s]`` their weights.
    sums: ``[S, rows, k]`` group loads per snapshot.  eps: ``[rows]`` smallest gain worth a swap.
    log: ``[rows, k, s]`` each item's logical expert, or None.  inc: ``[rows, k, E]`` replicas
    of each expert in each group, or None (no two replicas of one expert in a group).
    """

    mem: np.ndarray
    w: np.ndarray
    sums: np.ndarray
    eps: np.ndarray
    log: np.ndarray | None = None
    inc: np.ndarray | None = None

    @classmethod
    def start(cls, weights: np.ndarray, groups: np.ndarray, k: int,
              item_log: np.ndarray | None) -> _MinmaxState:
        snaps, layers, n = weights.shape
        mem = members_of(groups, k)
        flat = mem.reshape(layers, n)
        # snapshots first: the loops below run over them, on contiguous [rows, ...] blocks
        w = np.stack([np.take_along_axis(weights[i], flat, axis=1) for i in range(snaps)]
                     ).reshape(snaps, layers, k, n // k)
        eps = 1e-12 * np.maximum(weights.sum(axis=2).max(axis=0), 1.0)
        log = inc = None
        if item_log is not None:
            log = np.take_along_axis(item_log, flat, axis=1).reshape(layers, k, n // k)
            inc = np.zeros((layers, k, int(item_log.max()) + 1), dtype=np.int64)
            np.add.at(inc, (np.arange(layers)[:, None, None], np.arange(k)[None, :, None], log), 1)
        return cls(mem, w, w.sum(axis=3), eps, log, inc)

    def peaks(self, rows: np.ndarray) -> np.ndarray:
        """``[R, k]`` each group's load in its worst snapshot."""
        return self.sums[:, rows].max(axis=0)

    def candidates(self, rows: np.ndarray, a: np.ndarray, partners: np.ndarray
                   ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Best swap of group ``a`` with any group in ``partners`` (``[R, P]``), per row.

        The best swap leaves the pair's heavier peak (worst snapshot of either group) lowest;
        its gain is how much that peak drops (<= 0 when no swap helps; ``-inf`` where only
        forbidden swaps are left). Returns it and the positions in ``a`` and in the partner,
        and the partner group."""
        R, P = partners.shape
        s = self.w.shape[3]
        # rows in blocks whose [block, s, P*s] search arrays stay in the core's cache (about
        # 5x faster than one pass over all rows on the shared files; same values, same choice)
        step = max(1, _CACHE_FLOATS // (s * P * s))
        best = np.concatenate([self._search(rows[c:c + step], a[c:c + step],
                                            partners[c:c + step])
                               for c in range(0, R, step)] or [np.zeros(0, dtype=np.int64)])
        i, jj = best // (P * s), best % (P * s)
        j, b = jj % s, partners[np.arange(R), jj // s]
        return self.exact_gain(rows, a, i, b, j), (i, j, b)

    def _search(self, rows: np.ndarray, a: np.ndarray, partners: np.ndarray) -> np.ndarray:
        """``[R]`` flat index ``i * (P * s) + p * s + j`` of each row's best swap (the
        lowest such index among equal ones): item ``i`` of ``a`` for item ``j`` of the
        ``p``-th partner."""
        R, P = partners.shape
        snaps, s = self.w.shape[0], self.w.shape[3]
        # the search runs in float32 (half the memory traffic); the chosen swap's gain is then
        # recomputed in float64, so only a swap that truly helps is ever taken
        wa = self.w[:, rows, a].astype(np.float32)  # [S, R, s]
        wb = self.w[:, rows[:, None], partners].astype(np.float32).reshape(snaps, R, 1, P * s)
        sa = self.sums[:, rows, a].astype(np.float32)[:, :, None, None]
        sb = np.repeat(self.sums[:, rows[:, None], partners].astype(np.float32), s, axis=2)
        after = None  # [R, s, P*s]: the pair's heavier load after each swap, worst snapshot
        for x in range(snaps):
            load = wa[x][:, :, None] - wb[x]
            gone = sa[x] - load
            np.add(load, sb[x][:, None, :], out=load)
            np.maximum(gone, load, out=load)
            after = load if after is None else np.maximum(after, load, out=after)
        blocks = after.reshape(R, s, P, s)
        own = partners == a[:, None]  # a with itself: not a swap
        if own.any():
            r_own, p_own = np.nonzero(own)
            blocks[r_own, :, p_own, :] = np.inf
        if self.log is not None:
            # x (in a) may not join a partner holding x's expert, nor y (in b) join a
            xa = self.log[rows, a]  # [R, s]
            yb = self.log[rows[:, None], partners]  # [R, P, s]
            clash_a = self.inc[rows[:, None, None], partners[:, None, :], xa[:, :, None]] > 0
            clash_b = self.inc[rows[:, None, None], a[:, None, None], yb] > 0
            np.copyto(blocks, np.float32(np.inf),
                      where=clash_a[:, :, :, None] | clash_b[:, None, :, :])
        return np.argmin(after.reshape(R, s * P * s), axis=1)

    def exact_gain(self, rows: np.ndarray, a: np.ndarray, i: np.ndarray, b: np.ndarray,
                   j: np.ndarray) -> np.ndarray:
        """``[R]`` drop of the pair's heavier peak if item ``i`` of ``a`` and item ``j`` of
        ``b`` were exchanged (float64); ``-inf`` where ``a == b``."""
        d = self.w[:, rows, a, i] - self.w[:, rows, b, j]  # [S, R]
        sa, sb = self.sums[:, rows, a], self.sums[:, rows, b]
        before = np.maximum(sa.max(axis=0), sb.max(axis=0))
        after = np.maximum((sa - d).max(axis=0), (sb + d).max(axis=0))
        return np.where(a == b, -np.inf, before - after)

    def swap(self, rows: np.ndarray, ga: np.ndarray, i: np.ndarray, gb: np.ndarray,
             j: np.ndarray) -> None:
        """Exchange item ``i`` of group ``ga`` with item ``j`` of group ``gb`` in each row."""
        if len(rows) == 0:
            return
        if self.log is not None:
            move_log_counts(self.inc, self.log, rows, ga, i, gb, j)
        for arr in (self.mem,) + (() if self.log is None else (self.log,)):
            x, y = arr[rows, ga, i].copy(), arr[rows, gb, j].copy()
            arr[rows, ga, i], arr[rows, gb, j] = y, x
        wi, wj = self.w[:, rows, ga, i].copy(), self.w[:, rows, gb, j].copy()  # [S, R]
        self.w[:, rows, ga, i], self.w[:, rows, gb, j] = wj, wi
        self.sums[:, rows, ga] += wj - wi
        self.sums[:, rows, gb] += wi - wj

    def groups(self) -> np.ndarray:
        layers, k, s = self.mem.shape
        out = np.empty((layers, k * s), dtype=np.int64)
        np.put_along_axis(out, self.mem.reshape(layers, k * s),
                          np.broadcast_to(np.repeat(np.arange(k), s), (layers, k * s)), axis=1)
        return out


def refine_minmax(weights: np.ndarray, groups: np.ndarray, num_groups: int,
                  item_log: np.ndarray | None = None, max_rounds: int = 2000) -> np.ndarray:
    """Swap refinement against the worst snapshot: lower each layer's heaviest group load over
    all snapshots by swapping one item of a group with one item of another.

    Each round, in every layer still improving, groups are paired by their peak (load in their
    worst snapshot), heaviest with lightest, 2nd heaviest with 2nd lightest, ...; each pair
    takes the swap that lowers its heavier peak most. Where the heaviest group gains nothing
    from its partner it tries every other group; a layer where no pair gains is done. Every
    accepted swap lowers the larger of two peaks, so the peaks sorted heaviest first fall in
    lexicographic order and the loop ends.

    Args:
        weights: ``[S, layers, n]`` item weights per snapshot (comparable totals).
        groups: ``[layers, n]`` starting group of each item (exactly ``n / num_groups`` each).
        num_groups: groups per layer.
        item_log: ``[layers, n]`` optional logical expert of each item; no swap puts two
            replicas of one expert in one group.
        max_rounds: rounds at most.

    Returns:
        ``[layers, n]`` int64 refined groups (same sizes).
    """
    k = num_groups
    layers = groups.shape[0]
    st = _MinmaxState.start(weights, groups, k, item_log)
    active = np.arange(layers)
    pairs = k // 2
    if compiled_loops() is not None:  # the same rounds, one layer at a time, compiled
        from .kernels_minmax import refine_minmax_loop

        log, inc = (st.log, st.inc) if st.log is not None else (_NO_LOG, _NO_LOG)
        refine_minmax_loop(st.w, st.mem, st.sums, log, inc, st.log is not None, st.eps, pairs,
                           max_rounds)
        return st.groups()
    for _ in range(max_rounds):
        if len(active) == 0:
            break
        # groups paired by peak (their load in their worst snapshot), heaviest with lightest
        order = np.argsort(-st.peaks(active), axis=1, kind="stable")
        active = active[swap_round(st, active, order, k, pairs)]
    return st.groups()


def exact_minmax_groups(weights: np.ndarray, num_groups: int) -> np.ndarray:
    """The partition with the lowest heaviest group over all snapshots, by trying every one
    (at most ``EXACT_LIMIT``). ``weights``: ``[S, layers, n]``; returns ``[layers, n]``."""
    n = weights.shape[2]
    parts = _all_partitions(n, num_groups)  # [P, n]
    onehot = (parts[:, :, None] == np.arange(num_groups)).astype(np.float64)  # [P, n, k]
    sums = np.einsum("sln,pnk->lpsk", weights, onehot)  # [layers, P, S, k]
    return parts[np.argmin(sums.max(axis=(2, 3)), axis=1)]


def minmax_groups(weights: np.ndarray, num_groups: int,
                  item_log: np.ndarray | None = None) -> np.ndarray:
    """``[S, rows, n]`` item weights -> ``[rows, n]`` groups minimising the heaviest group over
    all snapshots: exactly when small enough (and no replicas), else heaviest-first on the
    snapshots' mean, replicas spread, then :func:`refine_minmax`."""
    n = weights.shape[2]
    if item_log is None and partition_count(n, num_groups) <= EXACT_LIMIT:
        return exact_minmax_groups(weights, num_groups)
    mean = weights.mean(axis=0)
    groups = greedy_groups(mean, num_groups)
    if item_log is not None:
        groups = _spread_duplicates(mean, item_log, groups, num_groups)
    return refine_minmax(weights, groups, num_groups, item_log=item_log)


def pack_flat(weights: np.ndarray, num_gpus: int, redundant: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """``[S, rows, E]`` loads -> ``(item_log, groups)``, both ``[rows, E + redundant]``:
    replicas for the highest peak load per replica, then :func:`minmax_groups`."""
    peak = weights.max(axis=0)
    item_log, counts = replicate_experts(peak, redundant, max_replicas=num_gpus)
    per = np.take_along_axis(counts, item_log, axis=1)
    item_w = np.stack([np.take_along_axis(w, item_log, axis=1) / per for w in weights])
    groups = minmax_groups(item_w, num_gpus, item_log if redundant else None)
    return item_log, groups


def pack_hierarchical(weights: np.ndarray, num_gpus: int, nodes: int, redundant: int,
                      expert_groups: int | None) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`pack_flat`, experts (or whole routing groups) to nodes first, each node's
    experts and ``redundant / nodes`` slots then to its GPUs; the layout of
    ``epsim.model.eplb.balance._pack_hierarchical`` (items node-major, node n owns GPUs n*G/N ..)."""
    snaps, rows, e = weights.shape
    per_node = e // nodes
    if expert_groups:
        size = e // expert_groups
        node_of_group = minmax_groups(weights.reshape(snaps, rows, expert_groups, size)
                                      .sum(axis=3), nodes)
        node_of_expert = np.repeat(node_of_group, size, axis=1)
    else:
        node_of_expert = minmax_groups(weights, nodes)
    experts = np.argsort(node_of_expert, axis=1, kind="stable").reshape(rows * nodes, per_node)
    node_w = np.stack([np.take_along_axis(np.repeat(w, nodes, axis=0), experts, axis=1)
                       for w in weights])
    inner_log, inner_groups = pack_flat(node_w, num_gpus // nodes, redundant // nodes)
    item_log = np.take_along_axis(experts, inner_log, axis=1)
    groups = inner_groups + np.tile(np.arange(nodes), rows)[:, None] * (num_gpus // nodes)
    n_items = item_log.shape[1]
    return (item_log.reshape(rows, nodes * n_items), groups.reshape(rows, nodes * n_items))


#: methods that use every snapshot (others fit the snapshots' mean): name -> packer
#: ``(weights [S, rows, E], num_gpus, nodes, redundant, expert_groups) -> (item_log, groups)``
SNAPSHOT_BALANCERS = {
    "minmax": lambda w, g, nodes, r, eg: (pack_hierarchical(w, g, nodes, r, eg) if nodes > 1
                                          else pack_flat(w, g, r)),
}
