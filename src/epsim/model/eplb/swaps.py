"""Swap refinement for the expert balancer (:mod:`epsim.model.eplb`): exchanges of items
between groups that lower the heavier group of each exchanging pair, vectorised over layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .pack import compiled_loops, members_of

#: a weight no real target comes near (masks items that may not be swapped)
_FAR = 1e300

#: stands for the logical experts and their counts where no replica rule applies
_NO_LOG = np.zeros((1, 1, 1), dtype=np.int64)


def _nearest_differences(wa: np.ndarray, wb: np.ndarray, half: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the ``i, j`` with ``wa[i] - wb[j]`` closest to ``half``, in ``O(m log m)``.

    Sorting ``wb`` together with the targets ``wa[i] - half`` puts each target next to its
    nearest values of ``wb``.

    Args:
        wa: ``[R, m]``; wb: ``[R, m2]``; half: ``[R]``.

    Returns:
        ``[R]`` each: the distance ``|wa[i] - wb[j] - half|``, ``i`` and ``j`` of the best pair.
    """
    rows, m2 = wb.shape
    m = wa.shape[1]
    targets = wa - half[:, None]
    # stable sorts: equal b values keep their index order, and a target lands after the b
    # values equal to it (the order numba's loops reproduce, kernels._nearest; numpy's
    # default sort leaves the order of equal keys to its SIMD kernels)
    ob = np.argsort(wb, axis=1, kind="stable")
    bs = np.take_along_axis(wb, ob, axis=1)
    # merge targets into b's sorted values; count the b's before each target
    merged = np.argsort(np.concatenate([bs, targets], axis=1), axis=1, kind="stable")
    is_b = merged < m2
    below = np.cumsum(is_b, axis=1)  # b values at or before each merged position
    # scatter the counts at the targets' merged positions into [rows, m] (flat: cheaper
    # than an inverse permutation)
    flat = merged + (np.arange(rows) * m - m2)[:, None]
    tgt = ~is_b
    pos = np.empty(rows * m, dtype=np.intp)
    pos[flat[tgt]] = below[tgt]
    pos = pos.reshape(rows, m)  # [R, m] b's <= target
    lo = np.maximum(pos - 1, 0)
    hi = np.minimum(pos, m2 - 1)
    dlo = np.abs(targets - np.take_along_axis(bs, lo, axis=1))
    dhi = np.abs(targets - np.take_along_axis(bs, hi, axis=1))
    dist = np.minimum(dlo, dhi)
    idx = np.arange(rows)
    i = np.argmin(dist, axis=1)
    # only the chosen target's neighbour is needed
    jsorted = np.where(dlo[idx, i] <= dhi[idx, i], lo[idx, i], hi[idx, i])
    return dist[idx, i], i, ob[idx, jsorted]


def swap_round(st: Any, active: np.ndarray, order: np.ndarray, k: int, pairs: int
               ) -> np.ndarray:
    """One swap round over the ``active`` layers, ``order`` ``[layers, k]`` their groups
    heaviest first; returns ``[layers]`` which layers improved (keep going). ``st`` is a swap
    state (``_SwapState``, or ``snapshots._MinmaxState`` whose loads are peaks over
    snapshots) with ``candidates(rows, a, b)`` -> ``(gain, (i, j, group_b))``, ``eps`` and
    ``swap(rows, a, i, group_b, j)``.

    Step 1: pair the groups heaviest with lightest, 2nd heaviest with 2nd lightest, ... and
    take each pair's best swap (disjoint pairs, so all apply at once). Step 2: where the
    heaviest group gains nothing from the lightest, it tries every other group instead (alone
    that round); where that fails too, the other pairs still even out (which can open new swaps
    for the heaviest), and a layer where nothing helps is done.
    """
    rows = np.repeat(active, pairs)
    a = order[:, :pairs].reshape(-1)
    b = order[:, ::-1][:, :pairs].reshape(-1)
    gain, (i, j, gb) = st.candidates(rows, a, b[:, None])
    ok = (gain > st.eps[rows]).reshape(len(active), pairs)
    stuck = np.flatnonzero(~ok[:, 0])
    top = order[stuck, 0]
    gain2, (i2, j2, gb2) = st.candidates(
        active[stuck], top, np.broadcast_to(np.arange(k), (len(stuck), k)))
    ok2 = gain2 > st.eps[active[stuck]]
    ok[stuck[ok2]] = False
    st.swap(active[stuck][ok2], top[ok2], i2[ok2], gb2[ok2], j2[ok2])
    flat_ok = ok.reshape(-1)
    st.swap(rows[flat_ok], a[flat_ok], i[flat_ok], gb[flat_ok], j[flat_ok])
    keep = ok.any(axis=1)
    keep[stuck[ok2]] = True
    return keep


def refine_swaps(weights: np.ndarray, groups: np.ndarray, num_groups: int,
                 max_rounds: int = 1000, tol: float = 0.0, home: np.ndarray | None = None,
                 max_moves: np.ndarray | int | None = None,
                 item_log: np.ndarray | None = None, exchange: bool = False) -> np.ndarray:
    """Pairwise-swap refinement: lower the heaviest group by swapping one of its items with one
    item of another group, as long as that lowers the pair's larger sum.

    Each round, in every layer that can still improve, the heaviest group trades with the
    lightest group the pair of items whose difference is closest to half their gap; a layer
    with no such pair tries every other group instead, and leaves when none helps. Every
    accepted swap strictly lowers the sum of squared group loads, so the loop terminates.

    Args:
        weights: ``[layers, n]`` item weights.
        groups: ``[layers, n]`` starting group of each item (exact sizes ``n / num_groups``).
        num_groups: groups per layer.
        max_rounds: swap rounds at most.
        tol: a layer stops once its heaviest group is within ``1 + tol`` of the mean group.
        home: ``[layers, n]`` optional group each item started in (its GPU in a previous
            placement); with ``max_moves``, a swap is taken only if afterwards at most
            ``max_moves`` items of the layer sit outside their home group.
        max_moves: an int or ``[layers]`` move budget (used with ``home``).
        item_log: ``[layers, n]`` optional logical expert of each item (replicas share one);
            then no swap puts two replicas of one expert in the same group.
        exchange: when no single swap helps a layer, try a two-for-two exchange between its
            heaviest and lightest groups before giving up (about 40x closer to the mean on the
            shared files, at 2-3x the time).

    Returns:
        ``[layers, n]`` int64 refined groups (same sizes).
    """
    layers, n = weights.shape
    k = num_groups
    s = n // k
    st = _SwapState.start(weights, groups, k, home, max_moves, item_log)
    active = np.arange(layers)
    # disjoint group pairs swap at once; with a move budget one swap a round keeps it exact
    pairs = k // 2 if home is None else 1
    target = (1.0 + tol) * weights.sum(axis=1) / k
    loops = compiled_loops() if home is None else None
    if loops is not None:  # the same rounds, one layer at a time, compiled
        log, inc = (st.log, st.inc) if st.log is not None else (_NO_LOG, _NO_LOG)
        loops.refine_swaps_loop(st.w, st.mem, st.sums, log, inc, st.log is not None, st.eps,
                                target, tol > 0, pairs, max_rounds, exchange)
        return st.groups(s)
    for _ in range(max_rounds):
        if tol > 0 and len(active):
            active = active[st.sums[active].max(axis=1) > target[active]]
        if len(active) == 0:
            break
        keep = swap_round(st, active, np.argsort(-st.sums[active], axis=1, kind="stable"), k,
                          pairs)
        if exchange and home is None:
            # Step 3: layers about to leave try a two-for-two exchange first
            leaving = np.flatnonzero(~keep)
            keep[leaving[st.pair_exchange(active[leaving])]] = True
        active = active[keep]
    return st.groups(s)


def move_log_counts(inc: np.ndarray, log: np.ndarray, rows: np.ndarray, ga: np.ndarray,
                    i: np.ndarray, gb: np.ndarray, j: np.ndarray) -> None:
    """Before item ``i`` of group ``ga`` and item ``j`` of group ``gb`` are exchanged in each row:
    move their logical experts' counts ``inc`` ``[rows, groups, experts]`` (``log``: the logical
    expert of each item) from the group each leaves to the group it joins."""
    x, y = log[rows, ga, i], log[rows, gb, j]
    np.add.at(inc, (rows, ga, x), -1)
    np.add.at(inc, (rows, gb, x), 1)
    np.add.at(inc, (rows, gb, y), -1)
    np.add.at(inc, (rows, ga, y), 1)


@dataclass
class _SwapState:
    """Mutable state of :func:`refine_swaps` (rows = layers, k groups of s items each).

    mem: ``[rows, k, s]`` item ids per group.  w: ``[rows, k, s]`` their weights.
    sums: ``[rows, k]`` group loads.  hm: ``[rows, k, s]`` each item's home group or None.
    moved / budget: ``[rows]`` items away from home, and the most allowed.
    eps: ``[rows]`` smallest gain worth a swap (float noise of the sums).
    log: ``[rows, k, s]`` each item's logical expert, or None (no replica constraint).
    inc: ``[rows, k, E]`` replicas of each expert in each group, or None.
    """

    mem: np.ndarray
    w: np.ndarray
    sums: np.ndarray
    hm: np.ndarray | None
    moved: np.ndarray | None
    budget: np.ndarray | None
    eps: np.ndarray
    log: np.ndarray | None = None
    inc: np.ndarray | None = None

    @classmethod
    def start(cls, weights: np.ndarray, groups: np.ndarray, k: int, home: np.ndarray | None,
              max_moves: np.ndarray | int | None,
              item_log: np.ndarray | None = None) -> _SwapState:
        layers, n = weights.shape
        mem = members_of(groups, k)
        flat = mem.reshape(layers, n)
        w = np.take_along_axis(weights, flat, axis=1).reshape(layers, k, n // k)
        hm = moved = budget = None
        if home is not None:
            hm = np.take_along_axis(home, flat, axis=1).reshape(layers, k, n // k)
            moved = (hm != np.arange(k)[None, :, None]).sum(axis=(1, 2))
            cap = n if max_moves is None else max_moves
            budget = np.broadcast_to(np.asarray(cap, dtype=np.int64), (layers,)).copy()
            # a start that already exceeds the budget may not get worse
            budget = np.maximum(budget, moved)
        eps = 1e-12 * np.maximum(weights.sum(axis=1), 1.0)
        log = inc = None
        if item_log is not None:
            log = np.take_along_axis(item_log, flat, axis=1).reshape(layers, k, n // k)
            inc = np.zeros((layers, k, int(item_log.max()) + 1), dtype=np.int64)
            np.add.at(inc, (np.arange(layers)[:, None, None], np.arange(k)[None, :, None], log), 1)
        return cls(mem, w, w.sum(axis=2), hm, moved, budget, eps, log, inc)

    def candidates(self, rows: np.ndarray, a: np.ndarray, partners: np.ndarray
                   ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Best swap of group ``a`` with any group in ``partners`` (``[R, P]``), per row.

        Returns the gain (drop of the pair's larger sum; <= 0 when none helps) and the
        position in ``a``, the position in the partner and the partner group."""
        if self.hm is None:
            return self._nearest_pairs(rows, a, partners)
        return self._all_pairs(rows, a, partners)

    def _all_pairs(self, rows: np.ndarray, a: np.ndarray, partners: np.ndarray
                   ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`candidates` by trying every pair (needed for the move budget and replicas)."""
        R, P = partners.shape
        s = self.w.shape[2]
        idx = np.arange(R)
        wa = self.w[rows, a]  # [R, s]
        wb = self.w[rows[:, None], partners].reshape(R, P * s)  # [R, P*s]
        diff = wa[:, :, None] - wb[:, None, :]  # [R, s, P*s]: how much moves from a to b
        sa = self.sums[rows, a][:, None, None]
        sb = np.repeat(self.sums[rows[:, None], partners], s, axis=1)[:, None, :]
        gain = np.minimum(diff, (sa - sb) - diff)
        pg = np.repeat(partners, s, axis=1)[:, None, :]
        gain = np.where(pg == a[:, None, None], -np.inf, gain)
        if self.hm is not None:
            ha = self.hm[rows, a][:, :, None]
            hb = self.hm[rows[:, None], partners].reshape(R, 1, P * s)
            ga = a[:, None, None]
            delta = ((ha != pg).astype(np.int64) - (ha != ga) + (hb != ga) - (hb != pg))
            fits = self.moved[rows][:, None, None] + delta <= self.budget[rows][:, None, None]
            gain = np.where(fits, gain, -np.inf)
        if self.log is not None:
            # no expert twice in one group: x may not join a group holding x's expert
            xa = self.log[rows, a]  # [R, s]
            yb = self.log[rows[:, None], partners].reshape(R, P * s)
            clash = (self.inc[rows[:, None, None], pg, xa[:, :, None]] > 0) | (
                self.inc[rows[:, None, None], a[:, None, None], yb[:, None, :]] > 0)
            gain = np.where(clash, -np.inf, gain)
        flat = gain.reshape(R, s * P * s)
        best = np.argmax(flat, axis=1)
        i, jj = best // (P * s), best % (P * s)
        return flat[idx, best], (i, jj % s, partners[idx, jj // s])

    def _nearest_pairs(self, rows: np.ndarray, a: np.ndarray, partners: np.ndarray
                       ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`candidates` without a move budget, in ``O(s log s)`` per group pair.

        The best swap of ``a`` with ``b`` moves ``d = w_i - w_j`` closest to half their gap
        ``h`` (the gain is ``h - |d - h|``); see :func:`_nearest_differences`."""
        R, P = partners.shape
        # one row per (row, partner); the partner a itself gets no candidates
        rr = np.repeat(rows, P)
        ga = np.repeat(a, P)
        gb = partners.reshape(-1)
        half = 0.5 * (self.sums[rr, ga] - self.sums[rr, gb])
        wa, wb = self.w[rr, ga], self.w[rr, gb]
        if self.log is not None:
            wa, wb = self._mask_clashes(rr, ga, gb, wa, wb)
        dist, i, j = _nearest_differences(wa, wb, half)
        gain = np.where(gb == ga, -np.inf, half - dist)
        gain, i, j = gain.reshape(R, P), i.reshape(R, P), j.reshape(R, P)
        best = np.argmax(gain, axis=1)
        idx = np.arange(R)
        return gain[idx, best], (i[idx, best], j[idx, best], partners[idx, best])

    def _mask_clashes(self, rows: np.ndarray, ga: np.ndarray, gb: np.ndarray, wa: np.ndarray,
                      wb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Items that may not cross (their expert is already on the other side) get weights
        no target can come near: ``+BIG`` in ``a``, ``-BIG`` in ``b``."""
        bad_a = self.inc[rows[:, None], gb[:, None], self.log[rows, ga]] > 0
        bad_b = self.inc[rows[:, None], ga[:, None], self.log[rows, gb]] > 0
        return np.where(bad_a, _FAR, wa), np.where(bad_b, -_FAR, wb)

    def pair_exchange(self, rows: np.ndarray) -> np.ndarray:
        """Two-for-two exchanges for layers where no single swap helps: the heaviest group
        gives two items to the lightest for two others, the sums of the pairs differing by
        about half the gap (``s^2 / 2`` pair sums on each side give a far finer choice of
        differences than ``s`` items). Applies the exchanges that lower the pair's larger sum
        and do not put one expert twice in a group; returns ``[R]`` which were applied."""
        k, s = self.w.shape[1:]
        if len(rows) == 0 or s < 2:
            return np.zeros(len(rows), dtype=bool)
        a = np.argmax(self.sums[rows], axis=1)
        b = np.argmin(self.sums[rows], axis=1)
        p1, p2 = np.triu_indices(s, 1)
        wa, wb = self.w[rows, a], self.w[rows, b]
        if self.log is not None:
            wa, wb = self._mask_clashes(rows, a, b, wa, wb)
        half = 0.5 * (self.sums[rows, a] - self.sums[rows, b])
        dist, i, j = _nearest_differences(wa[:, p1] + wa[:, p2], wb[:, p1] + wb[:, p2], half)
        gain = half - dist
        i1, i2, j1, j2 = p1[i], p2[i], p1[j], p2[j]
        ok = gain > self.eps[rows]
        r = rows[ok]
        self.swap(r, a[ok], i1[ok], b[ok], j1[ok])
        self.swap(r, a[ok], i2[ok], b[ok], j2[ok])
        return ok

    def swap(self, rows: np.ndarray, ga: np.ndarray, i: np.ndarray, gb: np.ndarray,
             j: np.ndarray) -> None:
        """Exchange item ``i`` of group ``ga`` with item ``j`` of group ``gb`` in each row."""
        if len(rows) == 0:
            return
        if self.log is not None:
            move_log_counts(self.inc, self.log, rows, ga, i, gb, j)
        extra = tuple(x for x in (self.hm, self.log) if x is not None)
        for arr in (self.w, self.mem) + extra:
            x, y = arr[rows, ga, i].copy(), arr[rows, gb, j].copy()
            if arr is self.hm:
                self.moved[rows] += ((x != gb).astype(np.int64) - (x != ga)
                                     + (y != ga) - (y != gb))
            arr[rows, ga, i], arr[rows, gb, j] = y, x
        wi, wj = self.w[rows, gb, j], self.w[rows, ga, i]  # after the exchange
        self.sums[rows, ga] += wj - wi
        self.sums[rows, gb] += wi - wj

    def groups(self, s: int) -> np.ndarray:
        layers, k, _ = self.mem.shape
        out = np.empty((layers, k * s), dtype=np.int64)
        np.put_along_axis(out, self.mem.reshape(layers, k * s),
                          np.broadcast_to(np.repeat(np.arange(k), s), (layers, k * s)), axis=1)
        return out
