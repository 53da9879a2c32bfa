"""The serving loop's per-step passes over the running requests, compiled with numba.

A step of a million-request run touches about a thousand running requests several times: their
gaps since the last output, their token counts, the sequences and context on each rank. numpy
does each of those as a few whole-array operations with a temporary apiece, and at a thousand
elements the calls, not the arithmetic, are the cost. Each function here is one loop over the
request ids doing a pass's work in place, with the arithmetic numpy's would do element for
element (sums in the ids' order, as ``np.bincount`` sums its weights), so the run's numbers do not
change (``tests/sim/serving/test_loop_kernels.py`` checks every kernel against the numpy expression it
replaces). Without numba the same source runs as Python (``model/compiled.py``).

    emit_tokens      one more output for each request of a step: its gap since its last
                     output (the gaps not equal to the first written out for the gap log), its
                     last-output time and token count updated, the requests now finished
    rank_batches     ``[ranks]`` sequences and summed context of requests on each rank
    off_ranks        the requests not on any of the given ranks
    rank_counts      ``[ranks]`` requests on each rank
    without          the running requests less those that finished
    release          the KV the finished requests held, given back to their ranks
"""

from __future__ import annotations

import numpy as np

from epsim.model.compiled import compiled as _compiled

_NO_EXTRA = np.zeros(0, dtype=np.int64)  # empty: no per-request token counts, no rank counts


@_compiled
def _emit_tokens(ids, t, last, generated, osl, extra, rest, rest_n, done):  # noqa: ANN001, ANN202
    g0 = t - last[ids[0]]
    same = 0
    finished = 0
    use_extra = extra.shape[0] > 0
    for j in range(ids.shape[0]):
        i = ids[j]
        gap = t - last[i]
        if gap == g0:
            same += 1
        else:
            rest[rest_n] = gap
            rest_n += 1
        last[i] = t
        generated[i] += extra[j] if use_extra else 1
        if generated[i] >= osl[i]:
            done[finished] = i
            finished += 1
    return g0, same, rest_n, finished


def emit_tokens(ids: np.ndarray, t: float, last: np.ndarray, generated: np.ndarray,
                osl: np.ndarray, counts: np.ndarray | None, rest: np.ndarray, rest_n: int
                ) -> tuple[float, int, int, np.ndarray]:
    """One output at ``t`` for each request of ``ids`` (non-empty, distinct), ``counts`` more
    tokens each (1 each when ``None``).

    Args:
        ids: ``[n]`` request ids. last / generated / osl: ``[requests]`` last-output time
            (updated to ``t``), tokens so far (updated), output length.
        rest: a buffer with room for ``n`` gaps from ``rest_n`` on: the gaps that differ from
            the first request's are written there, in ids order.

    Returns:
        ``(first gap, how many gaps equal it, the buffer's new fill, [finished ids])``.
    """
    extra = _NO_EXTRA if counts is None else np.asarray(counts, np.int64)
    done = np.empty(len(ids), dtype=np.int64)
    g0, same, rest_n, finished = _emit_tokens(ids, float(t), last, generated, osl, extra, rest,
                                              rest_n, done)
    return g0, int(same), int(rest_n), done[:finished]


@_compiled
def _rank_batches(ids, rank, isl, generated, seqs, ctx):  # noqa: ANN001, ANN202
    for j in range(ids.shape[0]):
        i = ids[j]
        r = rank[i]
        seqs[r] += 1
        ctx[r] += float(isl[i] + generated[i])


def rank_batches(ids: np.ndarray, rank: np.ndarray, isl: np.ndarray, generated: np.ndarray,
                 ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """``[ranks]`` requests of ``ids`` on each rank and their summed context (prompt plus
    tokens generated), in float64 summed in ids order: ``np.bincount(rank[ids])`` and
    ``np.bincount(rank[ids], weights=isl[ids] + generated[ids])``."""
    seqs = np.zeros(ranks, dtype=np.int64)
    ctx = np.zeros(ranks)
    _rank_batches(ids, rank, isl, generated, seqs, ctx)
    return seqs, ctx


@_compiled
def _off_ranks(ids, rank, excluded, out):  # noqa: ANN001, ANN202
    n = 0
    for j in range(ids.shape[0]):
        if not excluded[rank[ids[j]]]:
            out[n] = ids[j]
            n += 1
    return n


def off_ranks(ids: np.ndarray, rank: np.ndarray, excluded: np.ndarray) -> np.ndarray:
    """The ids (in order) whose rank is not ``excluded`` (``[ranks]`` bool):
    ``ids[~excluded[rank[ids]]]``."""
    out = np.empty(len(ids), dtype=np.int64)
    return out[:_off_ranks(ids, rank, excluded, out)]


@_compiled
def _rank_counts(ids, rank, out):  # noqa: ANN001, ANN202
    for j in range(ids.shape[0]):
        out[rank[ids[j]]] += 1


def rank_counts(ids: np.ndarray, rank: np.ndarray, ranks: int) -> np.ndarray:
    """``[ranks]`` requests of ``ids`` on each rank: ``np.bincount(rank[ids], minlength=ranks)``."""
    out = np.zeros(ranks, dtype=np.int64)
    _rank_counts(ids, rank, out)
    return out


@_compiled
def _without(ids, gone, mark, out, rank, per_rank):  # noqa: ANN001, ANN202
    for j in range(gone.shape[0]):
        mark[gone[j]] = True
    n = 0
    for j in range(ids.shape[0]):
        i = ids[j]
        if not mark[i]:
            out[n] = i
            n += 1
        elif per_rank.shape[0]:
            per_rank[rank[i]] -= 1
    for j in range(gone.shape[0]):
        mark[gone[j]] = False
    return n


def without(ids: np.ndarray, gone: np.ndarray, mark: np.ndarray,
            rank: np.ndarray | None = None, per_rank: np.ndarray | None = None) -> np.ndarray:
    """``ids`` (in order) less those in ``gone``, through ``mark`` (a bool per request id, all
    False, left so): ``ids[~np.isin(ids, gone)]`` in O(len(ids)). With ``rank`` and
    ``per_rank`` (``[ranks]`` counts of ``ids``), each id taken out is taken off its rank's
    count."""
    out = np.empty(len(ids), dtype=np.int64)
    if per_rank is None:
        rank, per_rank = ids, _NO_EXTRA  # unread: no counts to keep
    return out[:_without(ids, gone, mark, out, rank, per_rank)]


@_compiled
def _release(ids, rank, held, used):  # noqa: ANN001, ANN202
    for j in range(ids.shape[0]):
        i = ids[j]
        used[rank[i]] -= held[i]
        held[i] = 0


def release(ids: np.ndarray, rank: np.ndarray, held: np.ndarray, used: np.ndarray) -> None:
    """Give back what each request of ``ids`` (distinct) holds: ``used[rank[i]] -= held[i]``,
    then ``held[i] = 0`` (int64, exact)."""
    _release(ids, rank, held, used)
