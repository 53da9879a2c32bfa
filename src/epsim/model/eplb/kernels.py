"""The balancer's loops compiled with numba (``@njit(cache=True)``): greedy packing, replicas,
duplicate spreading, swap refinement and two-for-two exchanges (minmax: kernels_minmax).

The numpy code (pack, replicas, swaps) runs every round over all layers at once
on arrays of a few dozen items, so its time goes to numpy's cost per call. These loops are the
same algorithm one layer at a time (layers never interact; a layer stops here exactly when it
leaves the vectorised loop): same rounds, candidates, float operations in the same order,
first-index choices among equal values and stable sorts, so the placements are bit-identical
(tests/model/test_eplb_kernels.py). Without numba the numpy code runs (``ENABLED`` False). The
first call after an install compiles them (docs/performance.md); then numba's cache loads.

Arrays (rows = layers, k groups of s items): ``w`` ``[rows, k, s]`` item weights, ``mem``
``[rows, k, s]`` item ids, ``sums`` ``[rows, k]`` group loads, ``log`` ``[rows, k, s]``
logical experts and ``inc`` ``[rows, k, E]`` replicas per expert and group (``has_log``
False: no replica rule, placeholders), ``eps`` ``[rows]`` the smallest gain worth a swap.
"""

from __future__ import annotations

import numpy as np

from ..compiled import compiled as _compiled
from ..compiled import numba

#: whether the compiled loops are used (tests switch it off to compare with the numpy path)
ENABLED = numba is not None


@_compiled
def _stable_argsort(x):
    """``np.argsort(x, kind="stable")``: insertion sort for a few dozen values (a group's
    items, a layer's groups), a merge sort beyond (written out: numba's own sorts take
    seconds to compile)."""
    n = x.shape[0]
    order = np.empty(n, dtype=np.int64)
    for u in range(n):
        v = x[u]
        t = u
        while t > 0 and t > (u // 32) * 32 and x[order[t - 1]] > v:  # runs of 32, stable
            order[t] = order[t - 1]
            t -= 1
        order[t] = u
    other = np.empty(n, dtype=np.int64)
    width = 32
    while width < n:  # merge neighbouring runs; the left one first on equal values
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j = lo, mid
            for t in range(lo, hi):
                if i < mid and (j >= hi or x[order[j]] >= x[order[i]]):
                    other[t] = order[i]
                    i += 1
                else:
                    other[t] = order[j]
                    j += 1
        order, other = other, order
        width *= 2
    return order


@_compiled
def _may_cross(log, inc, has_log, r, g, other, out):
    """``out[q]``: whether item ``q`` of group ``g`` may join ``other`` (its expert is not
    there yet; always without the replica rule). The numpy path gives the others weights no
    target comes near (``+-swaps._FAR``): never the nearest while an allowed item is
    left, and a choice among them alone is never taken (its gain is about ``-_FAR``), so
    leaving them out chooses the same."""
    for q in range(out.shape[0]):
        out[q] = not has_log or inc[r, other, log[r, g, q]] == 0


# Scratch of refine_swaps_loop, passed as separate arrays (a tuple of them took numba seconds
# more to compile per function): ``order`` [k, s] each group's items sorted by weight;
# ``ver`` [2k + 1] each group's version stamp, the stamp its ``order`` was sorted at, and the
# last stamp; ``cand`` [k, k, 4] each kept candidate's two stamps and (i, j), ``cgain`` [k, k]
# its gain; ``fbuf`` [2, P] / ``ibuf`` [5, P + 1] buffers (P = s(s-1)/2 pairs); ``flags``
# [2, s] which items of the two groups may cross.


@_compiled
def _changed(ver, g):
    """Group ``g`` changed: its sorted items and every candidate it is in are stale (a new
    version stamp; stamps never repeat within one call)."""
    last = ver.shape[0] - 1
    ver[last] += 1
    ver[g] = ver[last]


@_compiled
def _sorted_items(w, r, g, order, ver):
    """Group ``g``'s item positions by weight, equal weights in position order (kept until
    the group changes)."""
    k = order.shape[0]
    if ver[k + g] != ver[g]:
        o = _stable_argsort(w[r, g])
        for q in range(o.shape[0]):  # element by element: a slice assignment compiles slowly
            order[g, q] = o[q]
        ver[k + g] = ver[g]
    return order[g]


@_compiled
def _pair_candidate(w, sums, log, inc, has_log, r, a, b, order, ver, cand, cgain, fbuf, ibuf,
                    flags):
    """The best single swap of group ``a`` with ``b`` in row ``r``: ``(gain, i, j)``
    (swaps._SwapState._nearest_pairs; gain ``-inf`` when ``a == b`` or nothing may
    cross). It depends on the two groups alone, so it is kept until either changes (a
    layer's heaviest group tries every other group round after round)."""
    if a == b:
        return -np.inf, 0, 0
    if cand[a, b, 0] != ver[a] or cand[a, b, 1] != ver[b]:
        g, i, j = _search_pair(w, sums, log, inc, has_log, r, a, b, order, ver, fbuf, ibuf,
                               flags)
        cand[a, b, 0] = ver[a]
        cand[a, b, 1] = ver[b]
        cand[a, b, 2] = i
        cand[a, b, 3] = j
        cgain[a, b] = g
    return cgain[a, b], cand[a, b, 2], cand[a, b, 3]


@_compiled
def _neighbour(t, vals, pos, c):
    """``(distance, position)`` of the nearer of ``t``'s neighbours in the sorted
    ``vals[:c]``, ``pos`` of which are ``<= t`` (swaps._nearest_differences: the lower
    one on equal distances)."""
    lo = max(pos - 1, 0)
    hi = min(pos, c - 1)
    dlo = abs(t - vals[lo])
    dhi = abs(t - vals[hi])
    if dlo <= dhi:
        return dlo, lo
    return dhi, hi


@_compiled
def _search_pair(w, sums, log, inc, has_log, r, a, b, order, ver, fbuf, ibuf, flags):
    """:func:`_pair_candidate` computed: b's allowed items in weight order, a's targets
    ``w - half`` merged into them."""
    bs, bpos, ca, cb = fbuf[0], ibuf[0], flags[0], flags[1]
    _may_cross(log, inc, has_log, r, b, a, cb)
    c = 0
    for q in _sorted_items(w, r, b, order, ver):  # b's allowed items, sorted: no sort needed
        if cb[q]:
            bs[c] = w[r, b, q]
            bpos[c] = q
            c += 1
    if c == 0:
        return -np.inf, 0, 0
    _may_cross(log, inc, has_log, r, a, b, ca)
    half = 0.5 * (sums[r, a] - sums[r, b])
    best = np.inf
    bi = -1
    bj = 0
    # a's targets w - half in ascending order (a's sorted items) merge into b's sorted
    # values: pos, the b values <= the target, only grows
    pos = 0
    for q in _sorted_items(w, r, a, order, ver):
        if not ca[q]:
            continue
        t = w[r, a, q] - half
        while pos < c and bs[pos] <= t:
            pos += 1
        d, u = _neighbour(t, bs, pos, c)
        if d < best or (d == best and q < bi):  # the first target among equal distances
            best, bi, bj = d, q, bpos[u]
    if bi < 0:
        return -np.inf, 0, 0
    return half - best, bi, bj


@_compiled
def _swap(w, mem, sums, log, inc, has_log, r, ga, i, gb, j, ver):
    """Exchange item ``i`` of group ``ga`` with item ``j`` of group ``gb`` (swaps
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
    _changed(ver, ga)  # both groups' sorted items and candidates are stale
    _changed(ver, gb)


@_compiled
def _stable_desc(x):
    """Indices of ``x`` heaviest first, equal values in index order (``argsort(-x, stable)``)."""
    neg = np.empty(x.shape[0])
    for u in range(x.shape[0]):  # loops, not numpy's array operations: they compile slowly
        neg[u] = -x[u]
    return _stable_argsort(neg)


@_compiled
def _swap_round(w, mem, sums, log, inc, has_log, eps, r, heavy, pairs, order, ver, cand,
                cgain, fbuf, ibuf, flags):
    """One round of swaps.swap_round for row ``r`` (``heavy``: its groups heaviest
    first); returns whether it improved."""
    k = heavy.shape[0]
    gains = np.empty(pairs)
    ii = np.empty(pairs, dtype=np.int64)
    jj = np.empty(pairs, dtype=np.int64)
    for p in range(pairs):
        gains[p], ii[p], jj[p] = _pair_candidate(w, sums, log, inc, has_log, r, heavy[p],
                                                 heavy[k - 1 - p], order, ver, cand, cgain,
                                                 fbuf, ibuf, flags)
    ok = np.empty(pairs, dtype=np.bool_)
    for p in range(pairs):
        ok[p] = gains[p] > eps[r]
    keep = False
    if not ok[0]:
        # the heaviest gains nothing from the lightest: it tries every group (first best)
        top = heavy[0]
        g2 = -np.inf
        i2 = j2 = b2 = 0
        for b in range(k):
            g, i, j = _pair_candidate(w, sums, log, inc, has_log, r, top, b, order, ver, cand,
                                      cgain, fbuf, ibuf, flags)
            if g > g2 or b == 0:
                g2, i2, j2, b2 = g, i, j, b
        if g2 > eps[r]:
            for p in range(pairs):
                ok[p] = False
            _swap(w, mem, sums, log, inc, has_log, r, top, i2, b2, j2, ver)
            keep = True
    for p in range(pairs):
        if ok[p]:
            _swap(w, mem, sums, log, inc, has_log, r, heavy[p], ii[p], heavy[k - 1 - p], jj[p],
                  ver)
            keep = True
    return keep


@_compiled
def _bucket(v, lo, scale, nb):
    """Bucket of value ``v``: a non-decreasing function of ``v`` (float rounding is
    monotone), so buckets split sorted values into contiguous runs."""
    x = (v - lo) * scale
    if x < 1.0:
        return 0
    return min(int(x), nb - 1)


@_compiled
def _bucket_sort(vals, ids, c, lo, hi, ibuf, sv, si):
    """Sort ``vals[:c]`` (min ``lo``, max ``hi``; with ``ids``, in id order for equal values)
    into ``sv``/``si`` by ``c`` buckets of equal width, insertion sort within each;
    ``ibuf[2][u]``: first position of bucket ``u`` (``[c] = c``). Returns the buckets'
    ``scale``. Exact whatever the buckets: they only group values, the insertion sort orders
    them (stable, so equal values keep the order they came in: ids ascending)."""
    start, bks, fill = ibuf[2], ibuf[3], ibuf[4]
    scale = c / (hi - lo) if hi > lo else 0.0
    for u in range(c + 1):  # loops, not slice assignments (those compile slowly)
        start[u] = 0
    for u in range(c):
        bk = _bucket(vals[u], lo, scale, c)
        bks[u] = bk
        start[bk + 1] += 1
    for u in range(c):
        start[u + 1] += start[u]
    for u in range(c + 1):  # each bucket's next free position
        fill[u] = start[u]
    for u in range(c):
        bk = bks[u]
        q = fill[bk]
        fill[bk] += 1
        v = vals[u]
        while q > start[bk] and sv[q - 1] > v:  # insertion sort within the bucket
            sv[q] = sv[q - 1]
            si[q] = si[q - 1]
            q -= 1
        sv[q] = v
        si[q] = ids[u]
    return scale


@_compiled
def _heaviest_lightest(x):
    """``(np.argmax(x), np.argmin(x))``: the first largest and the first smallest."""
    a = 0
    b = 0
    for u in range(1, x.shape[0]):
        if x[u] > x[a]:
            a = u
        if x[u] < x[b]:
            b = u
    return a, b


@_compiled
def _unrank(q, s):
    """The items ``(x, y)`` of pair ``q`` in ``np.triu_indices(s, 1)`` order."""
    x = 0
    while q >= s - 1 - x:
        q -= s - 1 - x
        x += 1
    return x, x + 1 + q


@_compiled
def _pair_exchange(w, mem, sums, log, inc, has_log, eps, r, ver, fbuf, ibuf, flags):
    """swaps._SwapState.pair_exchange for row ``r``: two items of the heaviest group for
    two of the lightest; returns whether it was applied. Pairs with an item that may not
    cross are left out (see :func:`_may_cross`). The lightest group's pair sums are sorted by
    buckets, and each target looks its neighbours up in its bucket (the same neighbours as
    the numpy path's merge, in expected constant time each)."""
    s = w.shape[2]
    if s < 2:
        return False
    a, b = _heaviest_lightest(sums[r])
    if a == b:  # all groups equal: no gain
        return False
    sv, vals, si, ids, start, ca, cb = fbuf[0], fbuf[1], ibuf[0], ibuf[1], ibuf[2], flags[0], \
        flags[1]
    _may_cross(log, inc, has_log, r, b, a, cb)
    _may_cross(log, inc, has_log, r, a, b, ca)
    c = 0
    q = 0  # the pair's rank in np.triu_indices(s, 1) order
    lo = np.inf
    hi = -np.inf
    for x in range(s):  # b's allowed pairs
        for y in range(x + 1, s):
            if cb[x] and cb[y]:
                v = w[r, b, x] + w[r, b, y]
                vals[c] = v
                ids[c] = q
                lo = min(lo, v)
                hi = max(hi, v)
                c += 1
            q += 1
    if c == 0:
        return False
    scale = _bucket_sort(vals, ids, c, lo, hi, ibuf, sv, si)
    half = 0.5 * (sums[r, a] - sums[r, b])
    best = np.inf
    bi = -1
    bj = 0
    q = -1
    for x in range(s):
        if not ca[x]:
            q += s - 1 - x
            continue
        wx = w[r, a, x]
        for y in range(x + 1, s):
            q += 1
            if not ca[y]:
                continue
            t = (wx + w[r, a, y]) - half
            bk = _bucket(t, lo, scale, c)
            pos = start[bk]  # every value of an earlier bucket is < t, of a later one > t
            while pos < start[bk + 1] and sv[pos] <= t:
                pos += 1
            d, u = _neighbour(t, sv, pos, c)
            if d < best:
                best, bi, bj = d, q, si[u]
        if best == 0.0:  # later targets can only tie, and the first one is kept
            break
    if bi < 0 or not half - best > eps[r]:
        return False
    a1, a2 = _unrank(bi, s)
    b1, b2 = _unrank(bj, s)
    _swap(w, mem, sums, log, inc, has_log, r, a, a1, b, b1, ver)
    _swap(w, mem, sums, log, inc, has_log, r, a, a2, b, b2, ver)
    return True


@_compiled
def refine_swaps_loop(w, mem, sums, log, inc, has_log, eps, target, use_tol, pairs,
                      max_rounds, exchange):
    """swaps.refine_swaps (no move budget) on every row, in place; ``target`` ``[rows]``
    the load a row stops at when ``use_tol``."""
    rows, k, s = w.shape
    big = max(s * (s - 1) // 2, s)
    order = np.zeros((k, s), dtype=np.int64)
    ver = np.zeros(2 * k + 1, dtype=np.int64)
    cand = np.empty((k, k, 4), dtype=np.int64)
    cand.fill(-1)
    cgain = np.zeros((k, k))
    fbuf = np.empty((2, big))
    ibuf = np.empty((5, big + 1), dtype=np.int64)
    flags = np.empty((2, s), dtype=np.bool_)
    for r in range(rows):
        for g in range(k):  # a new layer: nothing sorted, no candidate kept
            _changed(ver, g)
        for _ in range(max_rounds):
            if use_tol and sums[r, _heaviest_lightest(sums[r])[0]] <= target[r]:
                break
            keep = _swap_round(w, mem, sums, log, inc, has_log, eps, r, _stable_desc(sums[r]),
                               pairs, order, ver, cand, cgain, fbuf, ibuf, flags)
            if not keep and exchange:
                keep = _pair_exchange(w, mem, sums, log, inc, has_log, eps, r, ver, fbuf, ibuf,
                                      flags)
            if not keep:
                break


@_compiled
def greedy_loop(weights, num_groups):
    """pack.greedy_groups: ``[rows, n]`` weights -> ``[rows, n]`` groups."""
    rows, n = weights.shape
    size = n // num_groups
    groups = np.empty((rows, n), dtype=np.int64)
    key = np.empty(num_groups)
    fill = np.empty(num_groups, dtype=np.int64)
    for r in range(rows):
        order = _stable_desc(weights[r])
        for g in range(num_groups):
            key[g] = 0.0
            fill[g] = 0
        for step in range(n):
            g = _heaviest_lightest(key)[1]
            groups[r, order[step]] = g
            key[g] += weights[r, order[step]]
            fill[g] += 1
            if step >= size - 1 and fill[g] == size:
                key[g] = np.inf
    return groups


@_compiled
def replicate_loop(weights, num_redundant, max_replicas):
    """replicas.replicate_experts: ``(phy2log [rows, E + R], counts [rows, E])``."""
    rows, e = weights.shape
    phy2log = np.empty((rows, e + num_redundant), dtype=np.int64)
    counts = np.ones((rows, e), dtype=np.int64)
    for r in range(rows):
        for x in range(e):
            phy2log[r, x] = x
        for u in range(num_redundant):
            best = -np.inf
            hottest = 0
            for x in range(e):  # the most load per replica (the first of equal ones)
                v = weights[r, x] / counts[r, x] if counts[r, x] < max_replicas else -np.inf
                if v > best:
                    best = v
                    hottest = x
            phy2log[r, e + u] = hottest
            counts[r, hottest] += 1
    return phy2log, counts


@_compiled
def spread_loop(item_w, item_log, groups, num_groups, max_rounds):
    """replicas._spread_duplicates on every row, in place on ``groups``."""
    rows, n = groups.shape
    inc = np.zeros((num_groups, item_log.max() + 1), dtype=np.int64)
    for r in range(rows):
        for _ in range(max_rounds):
            for g in range(num_groups):
                for x in range(inc.shape[1]):
                    inc[g, x] = 0
            for q in range(n):
                inc[groups[r, q], item_log[r, q]] += 1
            i = -1  # the first item sharing its GPU with another replica of its expert
            for q in range(n):
                if inc[groups[r, q], item_log[r, q]] > 1:
                    i = q
                    break
            if i < 0:
                break
            g, e = groups[r, i], item_log[r, i]
            best = np.inf
            j = 0
            for q in range(n):  # the closest weight on a GPU without e, whose expert g lacks
                if (groups[r, q] != g and inc[groups[r, q], e] == 0
                        and inc[g, item_log[r, q]] == 0):
                    cost = abs(item_w[r, q] - item_w[r, i])
                    if cost < best:
                        best = cost
                        j = q
            if best == np.inf:
                break
            groups[r, i] = groups[r, j]
            groups[r, j] = g
