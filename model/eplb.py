"""Expert-parallel load balancing: placing experts on GPUs so every GPU carries the same load.

The public entry point is :func:`balance_placement`. Per layer it solves a *balanced number
partitioning* problem: split the layer's items (experts, or expert replicas) into ``G`` groups of
exactly ``n / G`` items whose summed loads are as equal as possible. Algorithms are registered
in ``BALANCERS`` (each maps ``[rows, n]`` weights and a group count to ``[rows, n]`` groups):

    greedy     heaviest item first onto the least-loaded GPU that still has a free slot
               (the public baseline, as in DeepSeek's EPLB ``balanced_packing``).
    kk         balanced largest differencing (Karmarkar-Karp with group sizes kept), no refinement.
    kk-swap    ``kk``, then pairwise-swap refinement.
    greedy-swap  ``greedy``, then the same refinement (epsim's default).
    greedy-swap2 ``greedy-swap`` plus two-for-two exchanges where single swaps stall.
    exact      every partition tried (small instances only).

The ``-swap`` methods solve instances with at most ``EXACT_LIMIT`` partitions exactly.

Options around the packer (all vectorised over layers, numpy only):

* redundant slots: replicate the hottest experts (highest load per replica first, as in
  DeepSeek's EPLB ``replicate_experts``), then pack the replicas, each carrying ``load / replicas``;
* hierarchical placement for multi-node EP: experts (or whole routing groups) to nodes first,
  then each node's experts (and its share of the redundant slots) to that node's GPUs;
* a previous placement: GPU labels are matched to it so the fewest experts move, and with
  ``max_moves`` the previous placement is only improved by swaps within that move budget.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import EpsimError
from .placement import Placement

# --------------------------------------------------------------------------------------------
# Packers: [rows, n] weights -> [rows, n] group ids, exactly n / num_groups items per group
# --------------------------------------------------------------------------------------------


def greedy_groups(weights: np.ndarray, num_groups: int) -> np.ndarray:
    """Heaviest-first packing into groups of exactly ``n / num_groups`` items.

    Args:
        weights: ``[layers, n]`` non-negative item weights.
        num_groups: groups per layer; must divide ``n``.

    Returns:
        ``[layers, n]`` int64: the group of each item.
    """
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


#: a weight no real target comes near (masks items that may not be swapped)
_FAR = 1e300


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
    r_ = np.arange(rows)[:, None]  # plain fancy indexing: cheaper than take_along_axis here
    targets = wa - half[:, None]
    ob = np.argsort(wb, axis=1)
    bs = wb[r_, ob]
    # merge targets into b's sorted values; count the b's before each target
    both = np.concatenate([bs, targets], axis=1)
    merged = np.argsort(both, axis=1)  # ties: either neighbour is checked below
    below = np.cumsum(merged < m2, axis=1)  # b values at or before each merged position
    where = np.empty_like(merged)
    where[r_, merged] = np.arange(both.shape[1])
    pos = below[r_, where[:, m2:]]  # [R, m] b's <= target
    lo = np.maximum(pos - 1, 0)
    hi = np.minimum(pos, m2 - 1)
    dlo = np.abs(targets - bs[r_, lo])
    dhi = np.abs(targets - bs[r_, hi])
    jsorted = np.where(dlo <= dhi, lo, hi)
    dist = np.minimum(dlo, dhi)
    idx = np.arange(rows)
    i = np.argmin(dist, axis=1)
    return dist[idx, i], i, ob[idx, jsorted[idx, i]]


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
    for _ in range(max_rounds):
        if tol > 0 and len(active):
            active = active[st.sums[active].max(axis=1) > target[active]]
        if len(active) == 0:
            break
        # Step 1: pair the groups heaviest with lightest, 2nd heaviest with 2nd lightest, ...
        # and find each pair's best swap (disjoint pairs, so all can be applied at once)
        order = np.argsort(-st.sums[active], axis=1)
        rows = np.repeat(active, pairs)
        a = order[:, :pairs].reshape(-1)
        b = order[:, ::-1][:, :pairs].reshape(-1)
        gain, (i, j, gb) = st.candidates(rows, a, b[:, None])
        ok = (gain > st.eps[rows]).reshape(len(active), pairs)
        # Step 2: where the heaviest group has nothing to gain from the lightest, it tries
        # every other group instead (alone that round); where that fails too, the other
        # pairs still even out (which can open new swaps for the heaviest), and a layer where
        # nothing helps is done
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
        if exchange and home is None:
            # Step 3: layers about to leave try a two-for-two exchange first
            leaving = np.flatnonzero(~keep)
            keep[leaving[st.pair_exchange(active[leaving])]] = True
        active = active[keep]
    return st.groups(s)


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
            x, y = self.log[rows, ga, i], self.log[rows, gb, j]
            np.add.at(self.inc, (rows, ga, x), -1)
            np.add.at(self.inc, (rows, gb, x), 1)
            np.add.at(self.inc, (rows, gb, y), -1)
            np.add.at(self.inc, (rows, ga, y), 1)
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


def _with_swaps(start: Callable[[np.ndarray, int], np.ndarray], exchange: bool = False
                ) -> Callable[[np.ndarray, int], np.ndarray]:
    """``start`` then :func:`refine_swaps`; instances small enough are solved exactly."""
    def packer(weights: np.ndarray, num_groups: int) -> np.ndarray:
        if partition_count(weights.shape[1], num_groups) <= EXACT_LIMIT:
            return exact_groups(weights, num_groups)
        return refine_swaps(weights, start(weights, num_groups), num_groups, exchange=exchange)
    return packer


_greedy_swap = _with_swaps(greedy_groups)
_greedy_swap2 = _with_swaps(greedy_groups, exchange=True)
_kk_swap = _with_swaps(kk_groups)


#: name -> packer(weights [rows, n], num_groups) -> groups [rows, n] (exactly n / num_groups each)
BALANCERS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "greedy": greedy_groups,
    "kk": kk_groups,
    "kk-swap": _kk_swap,
    "greedy-swap": _greedy_swap,
    "greedy-swap2": _greedy_swap2,
    "exact": exact_groups,
}

#: the start of each refined method (with replicas, the refinement runs once, constrained)
_STARTS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "kk-swap": kk_groups, "greedy-swap": greedy_groups, "greedy-swap2": greedy_groups,
}

#: epsim's choice: heaviest-first spreads the hottest experts one per GPU (which is what holds
#: up on loads it was not fitted to), the swaps then close the remaining gap almost exactly
DEFAULT_METHOD = "greedy-swap"


# --------------------------------------------------------------------------------------------
# Redundant experts, GPU relabelling, moves
# --------------------------------------------------------------------------------------------


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
    idx = np.arange(rows)
    phy2log = np.empty((rows, e + num_redundant), dtype=np.int64)
    phy2log[:, :e] = np.arange(e)
    counts = np.ones((rows, e), dtype=np.int64)
    if max_replicas is None or e * (max_replicas - 1) < num_redundant:
        max_replicas = num_redundant + 1
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


def _match_labels(new_groups: np.ndarray, item_log: np.ndarray, prev_inc: np.ndarray,
                  num_groups: int) -> np.ndarray:
    """Renumber each row's groups so that as many (GPU, expert) pairs as possible stay where the
    previous placement had them (fewer weights to move; the loads per GPU do not change).

    Greedy matching on the overlap matrix, then pairwise label exchanges while any helps.

    Args:
        new_groups: ``[rows, n]`` group of each item.  item_log: ``[rows, n]`` its expert.
        prev_inc: ``[rows, G, E]`` bool, expert held by GPU in the previous placement.

    Returns:
        ``[rows, n]`` relabelled groups.
    """
    rows, n = new_groups.shape
    k = num_groups
    idx = np.arange(rows)
    # overlap[r, g, h]: items of new group g whose expert GPU h held before
    held = prev_inc[idx[:, None, None], np.arange(k)[None, None, :], item_log[:, :, None]]
    overlap = np.zeros((rows, k, k), dtype=np.int64)
    np.add.at(overlap, (idx[:, None], new_groups), held.astype(np.int64))
    # Step 1: greedy: the largest remaining overlap fixes one label per pass
    label = np.full((rows, k), -1, dtype=np.int64)
    work = overlap.astype(np.float64)
    for _ in range(k):
        flat = np.argmax(work.reshape(rows, -1), axis=1)
        g, h = flat // k, flat % k
        label[idx, g] = h
        work[idx, g, :] = -np.inf
        work[idx, :, h] = -np.inf
    # Step 2: 2-opt: exchange the labels of two groups while that keeps more in place
    g1, g2 = np.triu_indices(k, 1)
    for _ in range(4 * k):
        l1, l2 = label[:, g1], label[:, g2]
        now = overlap[idx[:, None], g1, l1] + overlap[idx[:, None], g2, l2]
        then = overlap[idx[:, None], g1, l2] + overlap[idx[:, None], g2, l1]
        best = np.argmax(then - now, axis=1)
        better = (then - now)[idx, best] > 0
        if not better.any():
            break
        r = idx[better]
        a, b = g1[best[better]], g2[best[better]]
        la, lb = label[r, a].copy(), label[r, b].copy()
        label[r, a], label[r, b] = lb, la
    return np.take_along_axis(label, new_groups, axis=1)


def gpu_incidence(placement: Placement) -> np.ndarray:
    """``[layers, G, E]`` bool: whether each GPU holds (a replica of) each logical expert."""
    p2l = placement.physical_to_logical
    layers = p2l.shape[0]
    gpu = np.broadcast_to(np.arange(placement.num_slots) // placement.slots_per_gpu, p2l.shape)
    inc = np.zeros((layers, placement.num_gpus, placement.num_logical), dtype=bool)
    inc[np.arange(layers)[:, None], gpu, p2l] = True
    return inc


def moved_experts(previous: Placement, new: Placement) -> np.ndarray:
    """``[layers]`` expert weights to copy to go from ``previous`` to ``new``: the (GPU, expert)
    pairs that ``new`` has and ``previous`` had not."""
    if (previous.num_layers, previous.num_gpus, previous.num_logical) != \
            (new.num_layers, new.num_gpus, new.num_logical):
        raise EpsimError(
            f"previous placement is [{previous.num_layers} layers, {previous.num_gpus} GPUs, "
            f"{previous.num_logical} experts], the new one [{new.num_layers}, {new.num_gpus}, "
            f"{new.num_logical}]"
        )
    return (gpu_incidence(new) & ~gpu_incidence(previous)).sum(axis=(1, 2))


# --------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Packed:
    """Items of every row packed into groups.

    item_log: ``[rows, n]`` logical expert of each item (replicas repeat it).
    groups: ``[rows, n]`` GPU of each item, exactly ``n / G`` per GPU.
    """

    item_log: np.ndarray
    groups: np.ndarray


def _pack_flat(loads: np.ndarray, num_gpus: int, redundant: int, method: str) -> _Packed:
    """Replicate, then pack the replicas (each ``load / replicas``) onto ``num_gpus`` GPUs."""
    item_log, counts = replicate_experts(loads, redundant, max_replicas=num_gpus)
    item_w = np.take_along_axis(loads, item_log, axis=1) / np.take_along_axis(
        counts, item_log, axis=1)
    refined = method in _STARTS and partition_count(item_w.shape[1], num_gpus) > EXACT_LIMIT
    if not redundant or not refined:
        groups = BALANCERS[method](item_w, num_gpus)
    else:
        groups = _STARTS[method](item_w, num_gpus)
    if redundant:
        # replicas of one expert on one GPU waste a slot: spread them, then refine without
        # letting two meet again
        groups = _spread_duplicates(item_w, item_log, groups, num_gpus)
        if refined:
            # the no-two-replicas-on-a-GPU rule blocks many single swaps; two-for-two
            # exchanges get around it
            groups = refine_swaps(item_w, groups, num_gpus, item_log=item_log, exchange=True)
    return _Packed(item_log, groups)


def _pack_hierarchical(loads: np.ndarray, num_gpus: int, nodes: int, redundant: int,
                       method: str, expert_groups: int | None) -> _Packed:
    """Experts (or whole routing groups of ``E / expert_groups`` experts) to nodes, then each
    node's experts and ``redundant / nodes`` extra slots to its ``num_gpus / nodes`` GPUs."""
    rows, e = loads.shape
    per_node = e // nodes
    if expert_groups:
        # Step 1a: routing groups to nodes (group-limited routing then crosses fewer nodes)
        size = e // expert_groups
        group_loads = loads.reshape(rows, expert_groups, size).sum(axis=2)
        node_of_group = BALANCERS[method](group_loads, nodes)
        node_of_expert = np.repeat(node_of_group, size, axis=1)
    else:
        # Step 1b: single experts to nodes, E / nodes each
        node_of_expert = BALANCERS[method](loads, nodes)
    # Step 2: each (row, node) becomes a row of its own with that node's experts
    experts = np.argsort(node_of_expert, axis=1, kind="stable").reshape(rows * nodes, per_node)
    node_loads = np.take_along_axis(np.repeat(loads, nodes, axis=0), experts, axis=1)
    inner = _pack_flat(node_loads, num_gpus // nodes, redundant // nodes, method)
    # Step 3: back to global expert ids and GPU numbers (node n owns GPUs n*G/N ..)
    item_log = np.take_along_axis(experts, inner.item_log, axis=1)
    node = np.tile(np.arange(nodes), rows)[:, None]
    groups = inner.groups + node * (num_gpus // nodes)
    n_items = item_log.shape[1]
    return _Packed(item_log.reshape(rows, nodes * n_items),
                   groups.reshape(rows, nodes * n_items))


def _to_p2l(packed: _Packed, num_gpus: int) -> np.ndarray:
    """Items and their GPUs -> ``[rows, slots]`` physical_to_logical, each GPU's slots contiguous
    and, within a GPU, experts in ascending order."""
    key = packed.groups * (packed.item_log.max(initial=0) + 1) + packed.item_log
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(packed.item_log, order, axis=1)


def balance_placement(loads: np.ndarray, num_gpus: int, method: str = DEFAULT_METHOD, *,
                      redundant: int = 0, nodes: int = 1, expert_groups: int | None = None,
                      previous: Placement | None = None, max_moves: int | None = None
                      ) -> Placement:
    """Place each layer's experts on ``num_gpus`` GPUs, the same number of slots each, so that
    the summed loads per GPU are as equal as possible.

    Args:
        loads: ``[layers, experts]`` non-negative counts (all-zero rows are dense layers and get
            the contiguous placement).
        num_gpus: GPUs ``G``; must divide ``experts + redundant``.
        method: a key of ``BALANCERS`` (default ``DEFAULT_METHOD``).
        redundant: extra slots ``R`` per layer for replicas of the hottest experts, so each GPU
            has ``(experts + R) / G`` slots. Example: 32 (36 slots per GPU for 256 experts).
        nodes: ``N`` > 1 places hierarchically: experts to nodes, then to the node's GPUs
            (``N`` must divide ``G``, ``experts`` and ``R``).
        expert_groups: with ``nodes``, keep the model's routing groups (DeepSeek-V3: 8 groups of
            32 experts) whole on one node; ``N`` must divide it.
        previous: the placement in use; the new one's GPU numbers are matched to it so the
            fewest experts move (see :func:`moved_experts`).
        max_moves: with ``previous``: start from it and only swap experts, at most this many
            away from their previous GPU per layer (replica counts are kept).

    Returns:
        A :class:`Placement` with ``[layers, experts + R]`` slots.
    """
    # Step 1: check the inputs
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise EpsimError(f"loads must be [layers][experts], got shape {list(loads.shape)}")
    if not np.all(np.isfinite(loads)) or np.any(loads < 0):
        raise EpsimError("loads must be finite and non-negative")
    layers, e = loads.shape
    if method not in BALANCERS:
        raise EpsimError(f"unknown balancer {method!r} (known: {', '.join(BALANCERS)})")
    if num_gpus < 1 or redundant < 0 or nodes < 1:
        raise EpsimError(f"need num_gpus >= 1, redundant >= 0 and nodes >= 1, got {num_gpus}, "
                         f"{redundant}, {nodes}")
    slots = e + redundant
    if slots % num_gpus:
        raise EpsimError(f"{num_gpus} GPUs do not divide {e} experts + {redundant} redundant slots")
    if nodes > 1:
        if num_gpus % nodes or e % nodes or redundant % nodes:
            raise EpsimError(f"{nodes} nodes must divide the GPUs ({num_gpus}), experts ({e}) "
                             f"and redundant slots ({redundant})")
        if expert_groups and (e % expert_groups or expert_groups % nodes):
            raise EpsimError(f"{expert_groups} expert groups must divide the {e} experts and be "
                             f"a multiple of the {nodes} nodes")
    if previous is not None:
        if (previous.num_layers, previous.num_logical, previous.num_gpus) != (layers, e, num_gpus):
            raise EpsimError(
                f"previous placement is [{previous.num_layers} layers, {previous.num_logical} "
                f"experts, {previous.num_gpus} GPUs], the loads need [{layers}, {e}, {num_gpus}]")
        if max_moves is not None and previous.num_slots != slots:
            raise EpsimError(f"previous placement has {previous.num_slots} slots; with "
                             f"max_moves the redundant slots must stay {previous.num_slots - e}")
    if max_moves is not None and (previous is None or max_moves < 0):
        raise EpsimError("max_moves needs a previous placement and must be >= 0")

    # Step 2: dense rows keep the contiguous layout (replica slots wrap around)
    p2l = np.tile(np.arange(slots, dtype=np.int64) % e, (layers, 1))
    rows = np.flatnonzero(loads.sum(axis=1) > 0)
    if len(rows) == 0:
        return Placement(p2l, num_gpus=num_gpus, num_logical=e)
    w = loads[rows]

    # Step 3: pack the MoE rows
    if max_moves is not None:
        packed = _pack_from_previous(w, previous.physical_to_logical[rows],
                                     previous.replica_counts[rows], num_gpus, max_moves)
    elif nodes > 1:
        packed = _pack_hierarchical(w, num_gpus, nodes, redundant, method, expert_groups)
    else:
        packed = _pack_flat(w, num_gpus, redundant, method)
    if previous is not None and max_moves is None:
        # renumber GPUs (within each node, which keeps the node split) to move the fewest
        inc = gpu_incidence(previous)[rows]
        per = num_gpus // nodes
        n_rows, n_items = packed.groups.shape
        groups = packed.groups.reshape(n_rows, nodes, n_items // nodes).copy()
        logs = packed.item_log.reshape(n_rows, nodes, n_items // nodes)
        for node in range(nodes):
            local = groups[:, node] - node * per  # node-major items (see _pack_hierarchical)
            block = inc[:, node * per:(node + 1) * per]
            groups[:, node] = _match_labels(local, logs[:, node], block, per) + node * per
        packed = _Packed(packed.item_log, groups.reshape(n_rows, n_items))
    p2l[rows] = _to_p2l(packed, num_gpus)
    return Placement(p2l, num_gpus=num_gpus, num_logical=e)


def _pack_from_previous(loads: np.ndarray, prev_p2l: np.ndarray, prev_counts: np.ndarray,
                        num_gpus: int, max_moves: int) -> _Packed:
    """Swap refinement starting from the previous placement, with a move budget."""
    item_log = prev_p2l
    item_w = np.take_along_axis(loads, item_log, axis=1) / np.take_along_axis(
        prev_counts, item_log, axis=1)
    home = np.broadcast_to(np.arange(prev_p2l.shape[1]) // (prev_p2l.shape[1] // num_gpus),
                           prev_p2l.shape)
    groups = refine_swaps(item_w, home, num_gpus, home=home, max_moves=max_moves)
    return _Packed(item_log, groups)


# --------------------------------------------------------------------------------------------
# Summaries (what ``epsim balance`` prints)
# --------------------------------------------------------------------------------------------


def imbalance_summary(placement: Placement, loads: np.ndarray) -> dict[str, float]:
    """``{"mean", "max"}`` over the loaded layers of max GPU load / mean GPU load."""
    rows = np.flatnonzero(loads.sum(axis=1) > 0)
    imb = placement.imbalance(loads)[rows]
    return {"mean": float(np.mean(imb)), "max": float(np.max(imb))}


def lower_bound(loads: np.ndarray, num_gpus: int, redundant: int = 0) -> dict[str, float]:
    """``{"mean", "max"}`` over loaded layers of an imbalance no placement can beat.

    The busiest GPU carries at least the mean, at least the hottest expert's share (its load
    over the replicas it can have, one per GPU at most), and, for integer counts without
    replicas, the mean rounded up."""
    rows = loads[loads.sum(axis=1) > 0]
    mean = rows.sum(axis=1) / num_gpus
    split = min(num_gpus, redundant + 1)
    bound = np.maximum(mean, rows.max(axis=1) / split)
    if redundant == 0 and np.all(rows == np.round(rows)):
        bound = np.maximum(bound, np.ceil(mean - 1e-9))
    lb = bound / mean
    return {"mean": float(np.mean(lb)), "max": float(np.max(lb))}


def balance_report(loads: np.ndarray, num_gpus: int, method: str = DEFAULT_METHOD, *,
                   redundant: int = 0, nodes: int = 1, expert_groups: int | None = None,
                   previous: Placement | None = None, max_moves: int | None = None,
                   eval_loads: np.ndarray | None = None) -> tuple[Placement, dict]:
    """Balance, and measure the result: the placement and the summary ``epsim balance --json``
    prints (keys ``layers``, ``imbalance_before``/``imbalance_after`` as ``{"mean", "max"}``,
    ``lower_bound``, ``eval`` on ``eval_loads``, ``moved_experts`` with a previous placement,
    ``wall_ms`` of the balancing alone).

    "Before" is the previous placement when there is one, else the contiguous placement
    (without replicas when the GPUs divide the experts, else with the redundant slots wrapping
    round: :func:`~epsim.model.placement.contiguous_placement`).
    """
    from time import perf_counter

    from .placement import contiguous_placement

    loads = np.asarray(loads, dtype=np.float64)
    if eval_loads is not None and eval_loads.shape != loads.shape:
        raise EpsimError(f"evaluation loads of shape {list(eval_loads.shape)} do not match the "
                         f"fitted loads' {list(loads.shape)}")
    start = perf_counter()
    placement = balance_placement(loads, num_gpus, method, redundant=redundant, nodes=nodes,
                                  expert_groups=expert_groups, previous=previous,
                                  max_moves=max_moves)
    wall_ms = (perf_counter() - start) * 1e3
    layers, experts = loads.shape
    before = previous if previous is not None else contiguous_placement(
        layers, experts, num_gpus, 0 if experts % num_gpus == 0 else redundant)
    out: dict = {
        "layers": int(np.count_nonzero(loads.sum(axis=1) > 0)),
        "experts": loads.shape[1],
        "gpus": num_gpus,
        "nodes": nodes,
        "redundant": redundant,
        "slots_per_gpu": placement.slots_per_gpu,
        "method": method,
        "before": "previous" if previous is not None else "contiguous",
        "imbalance_before": imbalance_summary(before, loads),
        "imbalance_after": imbalance_summary(placement, loads),
        "lower_bound": lower_bound(loads, num_gpus, redundant),
    }
    if eval_loads is not None:
        out["eval"] = {"imbalance_before": imbalance_summary(before, eval_loads),
                       "imbalance_after": imbalance_summary(placement, eval_loads)}
    if previous is not None:
        moved = moved_experts(previous, placement)
        out["moved_experts"] = int(moved.sum())
        out["moved_experts_max_layer"] = int(moved.max())
    out["wall_ms"] = wall_ms
    return placement, out
