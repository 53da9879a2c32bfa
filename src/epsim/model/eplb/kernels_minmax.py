"""The minmax refinement (snapshots.refine_minmax) as loops that numba compiles: the same
rounds one layer at a time, the same float32 search and float64 gain, the same first choice
among equal values (see :mod:`epsim.model.eplb.kernels`; bit-identical placements, tested in
tests/model/test_eplb_kernels.py).

``_round`` mirrors kernels._swap_round (as swaps.swap_round serves both states in
the numpy path): numba would share it only through first-class functions, which compile slowly.

Arrays: ``w`` ``[S, rows, k, s]`` item weights per snapshot, ``mem`` ``[rows, k, s]`` item
ids, ``sums`` ``[S, rows, k]`` group loads, ``log`` / ``inc`` as in kernels (the replica
rule where ``has_log``), ``eps`` ``[rows]``.
"""

from __future__ import annotations

import numpy as np

from ..compiled import compiled as _compiled
from .kernels import _changed, _stable_desc

# Each group pair's best swap is kept until either group changes, in arrays passed one by one
# (a tuple of them took numba seconds more to compile): ``ver`` [k + 1] each group's version
# stamp and the last stamp, ``cand`` [k, k, 4] the two stamps a pair's best was found at and
# its (i, j), ``cval`` [k, k] its float32 peak.


@_compiled
def _pair_best(w, sums, log, inc, has_log, r, a, b):
    """The swap of ``a`` with ``b`` that leaves the pair's heavier peak lowest (float32, as
    snapshots._MinmaxState._search): ``(peak, i, j)``, the first ``(i, j)`` among equal
    peaks; ``(inf, 0, 0)`` when none is allowed."""
    snaps = w.shape[0]
    s = w.shape[3]
    wa = np.empty((snaps, s), dtype=np.float32)
    wb = np.empty((snaps, s), dtype=np.float32)
    sa = np.empty(snaps, dtype=np.float32)
    sb = np.empty(snaps, dtype=np.float32)
    for x in range(snaps):
        sa[x] = np.float32(sums[x, r, a])
        sb[x] = np.float32(sums[x, r, b])
        for q in range(s):
            wa[x, q] = np.float32(w[x, r, a, q])
            wb[x, q] = np.float32(w[x, r, b, q])
    best = np.float32(np.inf)
    bi = 0
    bj = 0
    if a == b:
        return best, bi, bj
    may_a = np.empty(s, dtype=np.bool_)  # x in a may join b (its expert is not there)
    may_b = np.empty(s, dtype=np.bool_)
    for q in range(s):
        may_a[q] = not has_log or inc[r, b, log[r, a, q]] == 0
        may_b[q] = not has_log or inc[r, a, log[r, b, q]] == 0
    for i in range(s):
        if not may_a[i]:
            continue
        for j in range(s):
            if not may_b[j]:
                continue
            after = np.float32(0.0)
            for x in range(snaps):
                load = wa[x, i] - wb[x, j]
                gone = sa[x] - load
                load = load + sb[x]
                load = max(gone, load)
                after = load if x == 0 else max(after, load)
            if after < best:
                best = after
                bi = i
                bj = j
    return best, bi, bj


@_compiled
def _kept_best(w, sums, log, inc, has_log, r, a, b, ver, cand, cval):
    """:func:`_pair_best`, kept until ``a`` or ``b`` changes."""
    if cand[a, b, 0] != ver[a] or cand[a, b, 1] != ver[b]:
        cval[a, b], cand[a, b, 2], cand[a, b, 3] = _pair_best(w, sums, log, inc, has_log, r, a,
                                                              b)
        cand[a, b, 0] = ver[a]
        cand[a, b, 1] = ver[b]
    return cval[a, b], cand[a, b, 2], cand[a, b, 3]


@_compiled
def _candidate(w, sums, log, inc, has_log, r, a, partners, ver, cand, cval):
    """snapshots._MinmaxState.candidates for row ``r``: the first flat index
    ``i * (P * s) + p * s + j`` among the lowest float32 peaks is the partner's best with the
    lowest peak, then the lowest ``i``, then the first partner; its gain then in float64
    (``-inf`` where ``a`` is the partner). Returns ``(gain, i, j, b)``."""
    best = np.float32(np.inf)
    bi = bj = bp = 0
    for p in range(partners.shape[0]):
        v, i, j = _kept_best(w, sums, log, inc, has_log, r, a, partners[p], ver, cand, cval)
        if p == 0 or v < best or (v == best and i < bi):
            best, bi, bj, bp = v, i, j, p
    b = partners[bp]
    if a == b:
        return -np.inf, bi, bj, b
    before = -np.inf
    after = -np.inf
    for x in range(w.shape[0]):
        d = w[x, r, a, bi] - w[x, r, b, bj]
        before = max(before, sums[x, r, a], sums[x, r, b])
        after = max(after, sums[x, r, a] - d, sums[x, r, b] + d)
    return before - after, bi, bj, b


@_compiled
def _swap(w, mem, sums, log, inc, has_log, r, ga, i, gb, j, ver):
    """snapshots._MinmaxState.swap for row ``r``."""
    if has_log:
        x = log[r, ga, i]
        y = log[r, gb, j]
        inc[r, ga, x] -= 1
        inc[r, gb, x] += 1
        inc[r, gb, y] -= 1
        inc[r, ga, y] += 1
        log[r, ga, i] = y
        log[r, gb, j] = x
    mi = mem[r, ga, i]
    mem[r, ga, i] = mem[r, gb, j]
    mem[r, gb, j] = mi
    for x in range(w.shape[0]):
        wi = w[x, r, ga, i]
        wj = w[x, r, gb, j]
        w[x, r, ga, i] = wj
        w[x, r, gb, j] = wi
        sums[x, r, ga] += wj - wi
        sums[x, r, gb] += wi - wj
    _changed(ver, ga)
    _changed(ver, gb)


@_compiled
def _round(w, mem, sums, log, inc, has_log, eps, r, order, pairs, ver, cand, cval):
    """swaps.swap_round with the minmax state for row ``r``; whether it improved."""
    k = order.shape[0]
    gains = np.empty(pairs)
    ii = np.empty(pairs, dtype=np.int64)
    jj = np.empty(pairs, dtype=np.int64)
    one = np.empty(1, dtype=np.int64)
    every = np.empty(k, dtype=np.int64)
    for g in range(k):
        every[g] = g
    for p in range(pairs):
        one[0] = order[k - 1 - p]
        gains[p], ii[p], jj[p], _ = _candidate(w, sums, log, inc, has_log, r, order[p], one,
                                               ver, cand, cval)
    ok = np.empty(pairs, dtype=np.bool_)
    for p in range(pairs):  # loops, not numpy's array operations: they compile slowly
        ok[p] = gains[p] > eps[r]
    keep = False
    if not ok[0]:
        top = order[0]
        g2, i2, j2, b2 = _candidate(w, sums, log, inc, has_log, r, top, every, ver,
                                    cand, cval)
        if g2 > eps[r]:
            for p in range(pairs):  # a loop: a slice assignment compiles slowly
                ok[p] = False
            _swap(w, mem, sums, log, inc, has_log, r, top, i2, b2, j2, ver)
            keep = True
    for p in range(pairs):
        if ok[p]:
            _swap(w, mem, sums, log, inc, has_log, r, order[p], ii[p], order[k - 1 - p], jj[p],
                  ver)
            keep = True
    return keep


@_compiled
def refine_minmax_loop(w, mem, sums, log, inc, has_log, eps, pairs, max_rounds):
    """snapshots.refine_minmax on every row, in place."""
    snaps, rows, k = sums.shape
    peaks = np.empty(k)
    ver = np.zeros(k + 1, dtype=np.int64)
    cand = np.empty((k, k, 4), dtype=np.int64)
    cand.fill(-1)
    cval = np.zeros((k, k), dtype=np.float32)
    for r in range(rows):
        for g in range(k):  # a new layer: no pair kept
            _changed(ver, g)
        for _ in range(max_rounds):
            for g in range(k):
                peaks[g] = sums[0, r, g]
                for x in range(1, snaps):
                    peaks[g] = max(peaks[g], sums[x, r, g])
            if not _round(w, mem, sums, log, inc, has_log, eps, r, _stable_desc(peaks), pairs,
                          ver, cand, cval):
                break
