"""The routing sample's normal split (``sim.routing``), compiled with numba.

When a GPU's slots average 16 pairs or more, its total is split over its slots from the normal
law with the multinomial's mean and covariance. numpy draws the normals (one whole-array call,
so the stream is the one it always was); this loop does the arithmetic of the former
whole-array expressions element for element, its sums in numpy's pairwise order, so the counts
are equal bit for bit (``tests/test_sim_routing.py`` checks them against the numpy
expressions). Without numba the same source runs as Python.

    normal_split   rows of totals split over their slots' shares from given normals
    pairwise_sum   ``a[lo:lo + n].sum()`` in numpy's order
"""

from __future__ import annotations

import numpy as np

from epsim.model.compiled import compiled as _compiled

#: numpy's unrolled block: up to this many items are summed by 8 running sums
_PAIRWISE_BLOCK = 128


@_compiled
def _block_sum(a, lo, n):  # noqa: ANN001, ANN202
    """numpy's pairwise sum of a run of at most ``_PAIRWISE_BLOCK`` items (its 8 running sums
    as locals: no array per call)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    stop = n - n % 8
    while i < stop:
        j = lo + i
        r0 += a[j]
        r1 += a[j + 1]
        r2 += a[j + 2]
        r3 += a[j + 3]
        r4 += a[j + 4]
        r5 += a[j + 5]
        r6 += a[j + 6]
        r7 += a[j + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@_compiled
def pairwise_sum(a, lo, n):  # noqa: ANN001, ANN201
    """``a[lo:lo + n].sum()`` in numpy's order, so a total equals numpy's bit for bit: blocks of
    8 running sums, longer runs split in halves (a multiple of 8 first) and the halves' sums
    added. The halving is walked with a stack (numba cannot cache a recursive function)."""
    if n <= _PAIRWISE_BLOCK:
        return _block_sum(a, lo, n)
    depth = 64
    seg_lo = np.empty(depth, dtype=np.int64)
    seg_n = np.empty(depth, dtype=np.int64)
    left_sum = np.empty(depth)
    left_done = np.zeros(depth, dtype=np.bool_)
    seg_lo[0], seg_n[0], top = lo, n, 0
    value = 0.0
    while True:
        m = seg_n[top]
        if m > _PAIRWISE_BLOCK and not left_done[top]:  # descend into its first half
            half = m // 2
            half -= half % 8
            top += 1
            seg_lo[top], seg_n[top], left_done[top] = seg_lo[top - 1], half, False
            continue
        value = _block_sum(a, seg_lo[top], m) if m <= _PAIRWISE_BLOCK else value
        # a finished run hands its sum up: a first half waits for its second, a second half
        # completes its parent (which then hands its own sum up)
        while True:
            if top == 0:
                return value
            parent = top - 1
            half = seg_n[parent] // 2
            half -= half % 8
            if not left_done[parent]:
                left_sum[parent], left_done[parent] = value, True
                seg_lo[top], seg_n[top], left_done[top] = (seg_lo[parent] + half,
                                                           seg_n[parent] - half, False)
                break
            value = left_sum[parent] + value
            top = parent


@_compiled
def normal_split(total, probs, z, out):  # noqa: ANN001, ANN201
    """Each row's ``total`` pairs over its slots (``probs`` ``[rows, S]``) from the normal law
    with the multinomial's mean ``N p`` and covariance ``N (diag p - p p^T)``, given the
    standard normals ``z`` ``[rows, S]``, into ``out`` ``[rows, S]``.

    ``y = sqrt(N p) z`` has covariance ``N diag(p)``; removing ``p`` times its sum gives the
    multinomial's exactly. Each slot's count is ``rint(N p + y - p sum(y))`` clipped at 0;
    rounding leaves a row's total off by a few pairs, which its likeliest slot (the first of the
    largest share) absorbs, clipped at 0."""
    rows, slots = probs.shape
    y = np.empty(slots)
    for r in range(rows):
        n = total[r]
        for s in range(slots):
            y[s] = np.sqrt(n * probs[r, s]) * z[r, s]
        y_sum = pairwise_sum(y, 0, slots)
        placed = 0.0
        hot = 0
        for s in range(slots):
            c = np.rint(n * probs[r, s] + y[s] - probs[r, s] * y_sum)
            c = c if c > 0.0 else 0.0  # as np.maximum(c, 0.0): -0.0 becomes 0.0
            out[r, s] = c
            placed += c
            if probs[r, s] > probs[r, hot]:
                hot = s
        fixed = out[r, hot] + (n - placed)
        out[r, hot] = fixed if fixed > 0.0 else 0.0
