"""The balancer's swap refinements as scalar loops that numba compiles (``@njit(cache=True)``).

The vectorised numpy code in :mod:`epsim.model.eplb_swaps` and
:mod:`epsim.model.eplb_snapshots` runs every round over all layers at once on arrays of a few
dozen items, so its time goes to numpy's per-call cost. The loops here are the same algorithm
one layer at a time (layers never interact, and a layer leaves the vectorised loop exactly when
its own loop here stops): the same rounds, the same candidates, the same float operations in the
same order (float32 where the minmax search uses float32), the same first-index choice among
equal values and the same stable sorts (equal keys keep their index order), so the placements
are bit-identical to the numpy path (tests/test_eplb_kernels.py). Without numba the numpy path
runs (``ENABLED`` is False); each function's ``py_func`` is the same code as Python.

Compiled once per machine (numba's on-disk cache, beside the module or in its user cache):
the first call after an install pays the compile (measured in docs/performance.md).

Arrays (rows = layers, k groups of s items, S snapshots): ``w`` ``[rows, k, s]`` (swaps) or
``[S, rows, k, s]`` (minmax) item weights, ``mem`` ``[rows, k, s]`` item ids, ``sums``
``[rows, k]`` / ``[S, rows, k]`` group loads, ``log`` ``[rows, k, s]`` logical experts and
``inc`` ``[rows, k, E]`` replicas per expert and group (``has_log`` False: no replica rule;
then they are placeholders), ``eps`` ``[rows]`` the smallest gain worth a swap.
"""

from __future__ import annotations

import numpy as np

try:  # numba compiles the loops; without it the numpy path runs (same placements)
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps a broken install usable
    numba = None

#: whether the compiled loops are used (tests switch it off to compare with the numpy path)
ENABLED = numba is not None


def _compiled(fn):
    """``fn`` compiled by numba with an on-disk cache where numba finds a writable place, per
    process where it finds none; ``fn.py_func`` is the Python function either way."""
    if numba is None:  # pragma: no cover
        fn.py_func = fn
        return fn
    try:
        return numba.njit(cache=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available" (read-only install)
        return numba.njit(fn)


@_compiled
def _stable_argsort(x):
    """``np.argsort(x, kind="stable")``: numba's quicksort (faster than its mergesort), then
    each run of equal values put back in index order."""
    order = np.argsort(x)
    n = x.shape[0]
    start = 0
    for q in range(1, n + 1):
        if q < n and x[order[q]] == x[order[start]]:
            continue
        if q - start > 16:  # a long run of equal values: back to index order
            order[start:q] = np.sort(order[start:q])
        elif q - start > 1:  # a short one (no allocation): insertion sort
            for u in range(start + 1, q):
                v = order[u]
                t = u
                while t > start and order[t - 1] > v:
                    order[t] = order[t - 1]
                    t -= 1
                order[t] = v
        start = q
    return order


@_compiled
def _nearest(wa, wb, half):
    """``(dist, i, j)``: the ``i, j`` with ``wa[i] - wb[j]`` closest to ``half`` (first ``i``
    among equal distances; ``j`` as eplb_swaps._nearest_differences picks it with stable
    sorts: ``wb`` sorted, each target ``wa[i] - half`` placed after the ``wb`` values equal to
    it, the lower neighbour on equal distances)."""
    m = wa.shape[0]
    m2 = wb.shape[0]
    ob = _stable_argsort(wb)
    bs = wb[ob]
    best = np.inf
    bi = 0
    bj = 0
    for x in range(m):
        t = wa[x] - half
        # pos: how many sorted b's are <= t (a binary search without branches to mispredict)
        base = 0
        n = m2
        while n > 1:
            h = n // 2
            base = base + h if bs[base + h] <= t else base
            n -= h
        pos = base + (1 if bs[base] <= t else 0)
        lo = max(pos - 1, 0)
        hi = min(pos, m2 - 1)
        dlo = abs(t - bs[lo])
        dhi = abs(t - bs[hi])
        d = min(dlo, dhi)
        if d < best:
            best = d
            bi = x
            bj = lo if dlo <= dhi else hi
            if d == 0.0:  # later targets can only tie, and the first one is kept
                break
    return best, bi, ob[bj]


@_compiled
def _crossing(w, log, inc, has_log, r, ga, gb):
    """``(weights, positions)`` of the items of group ``ga`` that may move to ``gb`` (all of
    them without the replica rule; else those whose expert ``gb`` does not hold yet).

    The numpy path gives the others weights no target comes near (``+-eplb_swaps._FAR``), so they are
    never the nearest while an allowed item is left, and a choice made among them only is
    never taken (its gain is about ``-_FAR``); leaving them out here chooses the same."""
    s = w.shape[2]
    vals = np.empty(s)
    pos = np.empty(s, dtype=np.int64)
    c = 0
    for q in range(s):
        if not has_log or inc[r, gb, log[r, ga, q]] == 0:
            vals[c] = w[r, ga, q]
            pos[c] = q
            c += 1
    return vals[:c], pos[:c]


@_compiled
def _pair_candidate(w, sums, log, inc, has_log, r, a, b):
    """The best single swap of group ``a`` with ``b`` in row ``r``: ``(gain, i, j)``
    (eplb_swaps._SwapState._nearest_pairs; gain ``-inf`` when ``a == b`` or nothing may
    cross)."""
    if a == b:
        return -np.inf, 0, 0
    wa, ia = _crossing(w, log, inc, has_log, r, a, b)
    wb, ib = _crossing(w, log, inc, has_log, r, b, a)
    if wa.shape[0] == 0 or wb.shape[0] == 0:
        return -np.inf, 0, 0
    half = 0.5 * (sums[r, a] - sums[r, b])
    dist, i, j = _nearest(wa, wb, half)
    return half - dist, ia[i], ib[j]


@_compiled
def _swap(w, mem, sums, log, inc, has_log, r, ga, i, gb, j):
    """Exchange item ``i`` of group ``ga`` with item ``j`` of group ``gb`` (eplb_swaps
    ``_SwapState.swap``: counts first, then the items, then the sums)."""
    if has_log:
        x = log[r, ga, i]
        y = log[r, gb, j]
        inc[r, ga, x] -= 1
        inc[r, gb, x] += 1
        inc[r, gb, y] -= 1
        inc[r, ga, y] += 1
        log[r, ga, i] = y
        log[r, gb, j] = x
    wi = w[r, ga, i]
    wj = w[r, gb, j]
    w[r, ga, i] = wj
    w[r, gb, j] = wi
    mi = mem[r, ga, i]
    mem[r, ga, i] = mem[r, gb, j]
    mem[r, gb, j] = mi
    sums[r, ga] += wj - wi
    sums[r, gb] += wi - wj


@_compiled
def _stable_desc(x):
    """Indices of ``x`` heaviest first, equal values in index order (``argsort(-x, stable)``)."""
    return _stable_argsort(-x)


@_compiled
def _swap_round(w, mem, sums, log, inc, has_log, eps, r, order, pairs):
    """One round of eplb_swaps.swap_round for row ``r``; returns whether it improved."""
    k = order.shape[0]
    gains = np.empty(pairs)
    ii = np.empty(pairs, dtype=np.int64)
    jj = np.empty(pairs, dtype=np.int64)
    for p in range(pairs):
        gains[p], ii[p], jj[p] = _pair_candidate(w, sums, log, inc, has_log, r, order[p],
                                                 order[k - 1 - p])
    ok = gains > eps[r]
    keep = False
    if not ok[0]:
        # the heaviest gains nothing from the lightest: it tries every group (first best)
        top = order[0]
        g2 = -np.inf
        i2 = j2 = b2 = 0
        for b in range(k):
            g, i, j = _pair_candidate(w, sums, log, inc, has_log, r, top, b)
            if g > g2 or b == 0:
                g2, i2, j2, b2 = g, i, j, b
        if g2 > eps[r]:
            ok[:] = False
            _swap(w, mem, sums, log, inc, has_log, r, top, i2, b2, j2)
            keep = True
    for p in range(pairs):
        if ok[p]:
            _swap(w, mem, sums, log, inc, has_log, r, order[p], ii[p], order[k - 1 - p], jj[p])
            keep = True
    return keep


@_compiled
def _pair_sums(vals, pos):
    """Sums of every two of ``vals`` and their positions, in ``np.triu_indices`` order."""
    c = vals.shape[0]
    n = c * (c - 1) // 2
    sums = np.empty(n)
    p1 = np.empty(n, dtype=np.int64)
    p2 = np.empty(n, dtype=np.int64)
    q = 0
    for x in range(c):
        for y in range(x + 1, c):
            sums[q] = vals[x] + vals[y]
            p1[q] = pos[x]
            p2[q] = pos[y]
            q += 1
    return sums, p1, p2


@_compiled
def _pair_exchange(w, mem, sums, log, inc, has_log, eps, r):
    """eplb_swaps._SwapState.pair_exchange for row ``r``: two items of the heaviest group for
    two of the lightest; returns whether it was applied. Pairs with an item that may not
    cross are left out (see :func:`_crossing`)."""
    if w.shape[2] < 2:
        return False
    a = np.argmax(sums[r])
    b = np.argmin(sums[r])
    if a == b:  # all groups equal: no gain
        return False
    pa, a1, a2 = _pair_sums(*_crossing(w, log, inc, has_log, r, a, b))
    pb, b1, b2 = _pair_sums(*_crossing(w, log, inc, has_log, r, b, a))
    if pa.shape[0] == 0 or pb.shape[0] == 0:
        return False
    half = 0.5 * (sums[r, a] - sums[r, b])
    dist, i, j = _nearest(pa, pb, half)
    if not half - dist > eps[r]:
        return False
    _swap(w, mem, sums, log, inc, has_log, r, a, a1[i], b, b1[j])
    _swap(w, mem, sums, log, inc, has_log, r, a, a2[i], b, b2[j])
    return True


@_compiled
def refine_swaps_loop(w, mem, sums, log, inc, has_log, eps, target, use_tol, pairs,
                      max_rounds, exchange):
    """eplb_swaps.refine_swaps (no move budget) on every row, in place; ``target`` ``[rows]``
    the load a row stops at when ``use_tol``."""
    rows = w.shape[0]
    for r in range(rows):
        for _ in range(max_rounds):
            if use_tol and np.max(sums[r]) <= target[r]:
                break
            keep = _swap_round(w, mem, sums, log, inc, has_log, eps, r,
                               _stable_desc(sums[r]), pairs)
            if not keep and exchange:
                keep = _pair_exchange(w, mem, sums, log, inc, has_log, eps, r)
            if not keep:
                break


@_compiled
def _mm_candidate(w, sums, log, inc, has_log, r, a, partners):
    """eplb_snapshots._MinmaxState.candidates for row ``r``: the swap of group ``a`` with a
    group of ``partners`` that leaves the pair's heavier peak lowest, searched in float32 (first
    flat index ``i * (P * s) + p * s + j`` among equal ones), its gain then in float64.
    Returns ``(gain, i, j, b)``."""
    snaps = w.shape[0]
    s = w.shape[3]
    n_p = partners.shape[0]
    wa = np.empty((snaps, s), dtype=np.float32)
    sa = np.empty(snaps, dtype=np.float32)
    wb = np.empty((n_p, snaps, s), dtype=np.float32)
    sb = np.empty((n_p, snaps), dtype=np.float32)
    for x in range(snaps):
        sa[x] = np.float32(sums[x, r, a])
        for q in range(s):
            wa[x, q] = np.float32(w[x, r, a, q])
        for p in range(n_p):
            sb[p, x] = np.float32(sums[x, r, partners[p]])
            for q in range(s):
                wb[p, x, q] = np.float32(w[x, r, partners[p], q])
    best_val = np.float32(np.inf)
    best = 0
    for i in range(s):
        for p in range(n_p):
            b = partners[p]
            if b == a or (has_log and inc[r, b, log[r, a, i]] > 0):
                continue
            for j in range(s):
                if has_log and inc[r, a, log[r, b, j]] > 0:
                    continue
                after = np.float32(0.0)
                for x in range(snaps):
                    load = wa[x, i] - wb[p, x, j]
                    gone = sa[x] - load
                    load = load + sb[p, x]
                    load = max(gone, load)
                    after = load if x == 0 else max(after, load)
                if after < best_val:
                    best_val = after
                    best = (i * n_p + p) * s + j
    i = best // (n_p * s)
    jj = best % (n_p * s)
    j = jj % s
    b = partners[jj // s]
    if a == b:
        return -np.inf, i, j, b
    before = -np.inf
    after64 = -np.inf
    for x in range(snaps):
        d = w[x, r, a, i] - w[x, r, b, j]
        before = max(before, sums[x, r, a], sums[x, r, b])
        after64 = max(after64, sums[x, r, a] - d, sums[x, r, b] + d)
    return before - after64, i, j, b


@_compiled
def _mm_swap(w, mem, sums, log, inc, has_log, r, ga, i, gb, j):
    """eplb_snapshots._MinmaxState.swap for row ``r``."""
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


@_compiled
def _mm_round(w, mem, sums, log, inc, has_log, eps, r, order, pairs):
    """eplb_swaps.swap_round with the minmax state for row ``r``; whether it improved."""
    k = order.shape[0]
    gains = np.empty(pairs)
    ii = np.empty(pairs, dtype=np.int64)
    jj = np.empty(pairs, dtype=np.int64)
    one = np.empty(1, dtype=np.int64)
    for p in range(pairs):
        one[0] = order[k - 1 - p]
        gains[p], ii[p], jj[p], _ = _mm_candidate(w, sums, log, inc, has_log, r, order[p], one)
    ok = gains > eps[r]
    keep = False
    if not ok[0]:
        top = order[0]
        g2, i2, j2, b2 = _mm_candidate(w, sums, log, inc, has_log, r, top, np.arange(k))
        if g2 > eps[r]:
            ok[:] = False
            _mm_swap(w, mem, sums, log, inc, has_log, r, top, i2, b2, j2)
            keep = True
    for p in range(pairs):
        if ok[p]:
            _mm_swap(w, mem, sums, log, inc, has_log, r, order[p], ii[p], order[k - 1 - p],
                     jj[p])
            keep = True
    return keep


@_compiled
def refine_minmax_loop(w, mem, sums, log, inc, has_log, eps, pairs, max_rounds):
    """eplb_snapshots.refine_minmax on every row, in place."""
    snaps, rows, k = sums.shape
    peaks = np.empty(k)
    for r in range(rows):
        for _ in range(max_rounds):
            for g in range(k):
                peaks[g] = sums[0, r, g]
                for x in range(1, snaps):
                    peaks[g] = max(peaks[g], sums[x, r, g])
            if not _mm_round(w, mem, sums, log, inc, has_log, eps, r, _stable_desc(peaks),
                             pairs):
                break


@_compiled
def greedy_loop(weights, num_groups):
    """eplb_pack.greedy_groups: ``[rows, n]`` weights -> ``[rows, n]`` groups."""
    rows, n = weights.shape
    size = n // num_groups
    groups = np.empty((rows, n), dtype=np.int64)
    key = np.empty(num_groups)
    fill = np.empty(num_groups, dtype=np.int64)
    for r in range(rows):
        order = _stable_desc(weights[r])
        key[:] = 0.0
        fill[:] = 0
        for step in range(n):
            g = np.argmin(key)
            groups[r, order[step]] = g
            key[g] += weights[r, order[step]]
            fill[g] += 1
            if step >= size - 1 and fill[g] == size:
                key[g] = np.inf
    return groups
