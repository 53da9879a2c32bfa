"""The fast executor's walk over a program's steps, compiled with numba.

``walk`` is ``sim.step.executor.program.run_fast``'s loop: every executor step (a collective, or a run of compute
ops) in issue order, each rank's stream, communication slots and the in-flight collectives that
slow compute (``comm_compute_slowdown``). It is written over plain arrays and scalar loops so that
numba compiles it (``@njit(cache=True)``: compiled once per machine, then loaded from the cache);
the same source runs as Python where numba is not installed (``walk.py_func`` when it is). The
arithmetic is the numpy walk's, operation for operation, so step times are bit-identical.
``walk`` stays one function on purpose, past the project's ~80-line guide: split into its
collective and compute-run steps it compiled in 7.2 s instead of 4.5 s, a cost every install
pays once on its first step.

Step arrays (``StepArrays``, from ``sim.step.executor.program.LaunchPlan``): per step ``coll`` (bool), ``first`` /
``last`` (issue index), ``group`` (collective group size), ``cat`` (category); ``ops_ptr`` /
``ops_idx`` the step's ops (CSR), ``waits_ptr`` / ``waits_idx`` the collectives (compute steps) or
dependencies (collectives) it waits for. ``quiet`` ``[n]``: collectives whose kernels hold no
compute units (they slow nothing).
"""

from __future__ import annotations

import numpy as np

from epsim.model.compiled import compiled as _compiled


@_compiled
def _fluid(t0: float, w: float, iv_from: np.ndarray, iv_to: np.ndarray, head: int, tail: int,
           r: int, s: float) -> float:
    """End of ``w`` seconds of compute from ``t0`` on rank ``r``, at ``1 - s`` inside the
    in-flight intervals ``head .. tail-1`` (sim.step.executor.program._fluid, one rank)."""
    t = t0
    slow = 1.0 - s
    for j in range(head, tail):
        cs = iv_from[j, r]
        ce = iv_to[j, r]
        gap = cs - t
        use = min(w, gap if gap > 0.0 else 0.0)
        t = t + use
        w = w - use
        at = t if t > cs else cs
        span = ce - at
        use = min(w, (span if span > 0.0 else 0.0) * slow)
        if use > 0:
            t = at + use / slow
        w = w - use
    return t + w


# one function on purpose (over the 100-line limit): numba compiles the whole walk as one loop;
# split into calls, every step would pass the executor's dozen state arrays through arguments
@_compiled
def walk(coll, first, last, group, cat, ops_ptr, ops_idx, waits_ptr, waits_idx,  # noqa: PLR0913
         work, cats, floor, host_sync, host_release_s, quiet, launch_s, eager, slots, s,
         launch_cat,
         start, end, held, held_cat, gaps, gap_cat, busy_all, work_steps, stream, comm_free):
    """Walk every step; fills ``start``/``end`` ``[n, ranks]`` and the per-compute-step arrays
    ``held``/``gaps``/``gap_cat``/``busy_all``/``work_steps`` ``[k, ranks]`` and ``held_cat``
    ``[k]``; leaves each rank's stream end in ``stream`` and its slots' in ``comm_free``."""
    ranks = work.shape[1]
    steps = coll.shape[0]
    cap = 0
    for st in range(steps):
        if coll[st]:
            cap += 1
    iv_from = np.zeros((max(cap, 1), ranks))
    iv_to = np.zeros((max(cap, 1), ranks))
    iv_latest = np.zeros(max(cap, 1))
    head = 0
    tail = 0
    comm_taken = np.zeros(ranks)
    host = np.zeros(ranks)
    sync_end = np.zeros(ranks)
    sync_cat = launch_cat
    f = np.zeros(ranks)
    arrive = np.zeros(ranks)
    begin = np.zeros(ranks)
    ready = np.zeros(ranks)
    k = 0
    for st in range(steps):
        i0 = first[st]
        for r in range(ranks):
            if eager:
                host[r] = host[r] + launch_s[i0]
                f[r] = host[r] if host[r] > floor[i0] else floor[i0]
            else:
                f[r] = floor[i0]
        if coll[st]:
            for r in range(ranks):
                lo = comm_free[0, r]
                for q in range(1, slots):
                    if comm_free[q, r] < lo:
                        lo = comm_free[q, r]
                a = lo if lo > comm_taken[r] else comm_taken[r]
                a = a if a > f[r] else f[r]
                for p in range(waits_ptr[st], waits_ptr[st + 1]):
                    e = end[waits_idx[p], r]
                    a = a if a > e else e
                arrive[r] = a
            g = group[st]
            if g > 1:
                for g0 in range(0, ranks, g):
                    b = arrive[g0]
                    for r in range(g0 + 1, g0 + g):
                        b = b if b > arrive[r] else arrive[r]
                    for r in range(g0, g0 + g):
                        begin[r] = b
            else:
                for r in range(ranks):
                    begin[r] = arrive[r]
            holds = not quiet[i0]  # a quiet exchange's kernel frees the CUs: no interference
            latest = -np.inf
            for r in range(ranks):
                done = begin[r] + work[i0, r]
                start[i0, r] = begin[r]
                end[i0, r] = done
                q_min = 0
                for q in range(1, slots):  # the first free slot, as argmin picks it
                    if comm_free[q, r] < comm_free[q_min, r]:
                        q_min = q
                comm_free[q_min, r] = done
                comm_taken[r] = arrive[r]
                if holds:
                    # keep the in-flight intervals disjoint: a collective overlapping the
                    # previous one (two slots) adds only the part after it
                    bf = begin[r]
                    if tail > head and iv_to[tail - 1, r] > bf:
                        bf = iv_to[tail - 1, r]
                    bt = done if done > bf else bf
                    iv_from[tail, r] = bf
                    iv_to[tail, r] = bt
                    if bt > latest:
                        latest = bt
            if holds:
                iv_latest[tail] = latest
                tail += 1
            if eager and host_sync[i0]:
                for r in range(ranks):
                    release = begin[r] + host_release_s[i0]
                    host[r] = host[r] if host[r] > release else release
                    sync_end[r] = release
                sync_cat = cat[st]
            continue
        # a run of compute ops: only the first waits on anything but its predecessor
        has_waits = waits_ptr[st + 1] > waits_ptr[st]
        for r in range(ranks):
            rd = stream[r] if stream[r] > f[r] else f[r]
            wc = launch_cat
            if has_waits:
                we = f[r]
                for p in range(waits_ptr[st], waits_ptr[st + 1]):
                    d = waits_idx[p]
                    e = end[d, r]
                    if e > we:
                        wc = cats[d]
                    we = we if we > e else e
                rd = rd if rd > we else we
            gap_cat[k, r] = wc
            ready[r] = rd
            gap = rd - stream[r]
            if eager:
                hold = 0.0
                if wc == launch_cat:
                    x = (sync_end[r] if sync_end[r] < rd else rd) - stream[r]
                    hold = x if x > 0.0 else 0.0
                held[k, r] = hold
                gap = gap - hold
            gaps[k, r] = gap
        if eager:
            held_cat[k] = sync_cat
        if tail > head:
            # intervals over on every rank can no longer slow anything
            ready_min = ready[0]
            for r in range(1, ranks):
                if ready[r] < ready_min:
                    ready_min = ready[r]
            while tail > head and iv_latest[head] <= ready_min:
                head += 1
        p0 = ops_ptr[st]
        p1 = ops_ptr[st + 1]
        for r in range(ranks):
            w = work[ops_idx[p0], r]
            for p in range(p0 + 1, p1):
                w = w + work[ops_idx[p], r]
            if tail > head and s != 0.0:
                fin = _fluid(ready[r], w, iv_from, iv_to, head, tail, r, s)
            else:
                fin = ready[r] + w
            start[i0, r] = ready[r]
            end[last[st], r] = fin
            busy_all[k, r] = fin - ready[r]
            work_steps[k, r] = w
            stream[r] = fin
        if eager and host_sync[i0]:
            for r in range(ranks):
                host[r] = host[r] if host[r] > stream[r] else stream[r]
                sync_end[r] = stream[r]
            sync_cat = cat[st]
        k += 1
