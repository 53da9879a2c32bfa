"""What the serving loop's schedulers look at: requests, and each side's queues and running set.

    RequestState   per-request arrays shared by the client, the KV pools and every side
    Running        the requests a side is decoding, in the order they started (preemption
                   takes the newest)
    SideQueues     one side's dp ranks: a FIFO waiting queue per rank, at most one
                   part-prefilled request per rank, and the running set
    Client         the benchmark client: issues requests, holds at most ``cap`` in flight
    EventLoop      a min-heap of timed callbacks

A request that was preempted (its KV freed, vLLM) or retracted (SGLang) waits again and
recomputes everything it had: its prompt and the tokens it had generated
(:meth:`RequestState.prefill_target`), then decodes on.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from epsim.sim.workload.spec import Requests

from .loop_kernels import emit_tokens, rank_counts, without
from .tally import GapLog


class RequestState:
    """Per-request arrays (index = request id), shared by the client and every side.

    isl / osl: input and output tokens. send / first / done / last: send time, first token,
    last token, latest token so far. generated / prefilled: output tokens emitted, prompt
    tokens computed toward :meth:`prefill_target`. rank: the dp rank that decodes it.
    owner: the instance that decodes it (0 with one instance). preemptions: times its KV was
    taken back. gaps: the inter-token gaps as they are emitted (``sim.serving.tally.GapLog``; the
    per-request lists too with ``keep_requests``).
    """

    def __init__(self, req: Requests, keep_requests: bool = True) -> None:
        n = len(req)
        self.isl = req.input_lens.astype(np.int64)
        self.osl = req.output_lens.astype(np.int64)
        self.send = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.last = np.full(n, np.nan)
        self.generated = np.zeros(n, dtype=np.int64)
        self.prefilled = np.zeros(n, dtype=np.int64)
        self.rank = np.full(n, -1, dtype=np.int64)
        self.owner = np.zeros(n, dtype=np.int64)
        self.preemptions = np.zeros(n, dtype=np.int64)
        self.gaps = GapLog(keep_requests)

    def prefill_target(self, i: int) -> int:
        """Tokens request ``i`` computes before it decodes: its prompt, plus the tokens it had
        generated when it was preempted (recompute)."""
        return int(self.isl[i] + self.generated[i])

    def prefill_left(self, i: int) -> int:
        return self.prefill_target(i) - int(self.prefilled[i])

    def emit(self, ids: np.ndarray, t: float, counts: np.ndarray | None = None,
             instance: int = 0) -> np.ndarray:
        """One more token (``counts`` more under MTP) for each request of ``ids`` at ``t``, as
        one output each (one inter-token gap, as vLLM's client times a streamed chunk), by
        ``instance``; returns those now finished."""
        if not len(ids):
            return ids
        if not self.gaps.keep_requests:  # one compiled pass (sim/serving/loop_kernels.py)
            rest, rest_n = self.gaps.rest_buffer(instance, len(ids))
            first_gap, n_same, rest_n, done = emit_tokens(ids, t, self.last, self.generated,
                                                          self.osl, counts, rest, rest_n)
            self.gaps.add_counted(first_gap, n_same, len(ids), rest_n, t, instance)
            return done
        self.gaps.add(t - self.last[ids], ids, t, instance)
        self.last[ids] = t
        self.generated[ids] += 1 if counts is None else counts
        return ids[self.generated[ids] >= self.osl[ids]]


def rank_mask(ranks: int, chosen: Iterable[int]) -> np.ndarray:
    """``[ranks]`` True for the ranks in ``chosen`` (read-only: one array per set of ranks,
    kept, since a run meets the same few sets step after step)."""
    key = (ranks, *chosen)
    mask = _RANK_MASKS.get(key)
    if mask is None:
        if len(_RANK_MASKS) >= RANK_MASKS_KEPT:  # many dp ranks meet many sets: start again
            _RANK_MASKS.clear()
        mask = np.zeros(ranks, dtype=bool)
        mask[list(key[1:])] = True
        mask.flags.writeable = False
        _RANK_MASKS[key] = mask
    return mask


_RANK_MASKS: dict[tuple[int, ...], np.ndarray] = {}
RANK_MASKS_KEPT = 4096


class Running:
    """Requests in decode, one array of ids over all ranks, oldest first.

    Requests whose prefill ends join at the next step's start (:meth:`flush`), so every event
    of one instant lands before a step is formed.
    """

    def __init__(self, ranks: int) -> None:
        self.ids = np.zeros(0, dtype=np.int64)
        self.ranks = ranks
        self._incoming: list[int] = []
        self._gone = np.zeros(0, dtype=bool)
        self._top = 0  # the largest id that joined
        # from the first count() on, the requests on each rank, kept as they join and leave
        # (a request keeps its rank while it runs), and the rank of each request
        self._per_rank: np.ndarray | None = None
        self._rank: np.ndarray | None = None
        # ``on_rank``'s split of ``ids`` by rank, kept until ``ids`` changes (a step asks it
        # for every rank: one stable sort instead of a scan of every id per rank)
        self._version = 0
        self._split: tuple[int, list[np.ndarray]] | None = None

    def add(self, i: int) -> None:
        self._incoming.append(i)

    def flush(self) -> None:
        if self._incoming:
            self._top = max(self._top, max(self._incoming))
            joined = np.array(self._incoming, dtype=np.int64)
            self.ids = np.concatenate([self.ids, joined])
            self._version += 1
            self._incoming = []
            if self._per_rank is not None:
                self._per_rank += rank_counts(joined, self._rank, self.ranks)

    def remove(self, ids: np.ndarray) -> None:
        if len(ids):
            # a mark per request id (O(running), not a sort like np.isin), cleared after
            top = max(self._top, max(ids.tolist())) + 1
            if len(self._gone) < top:
                self._gone = np.zeros(max(top, 2 * len(self._gone)), dtype=bool)
            self.ids = without(self.ids, ids, self._gone, self._rank, self._per_rank)
            self._version += 1

    def count(self, st: RequestState) -> np.ndarray:
        """``[ranks]`` requests decoding on each rank (not those joining at the next flush)."""
        if self._per_rank is None:
            self._rank = st.rank
            self._per_rank = rank_counts(self.ids, st.rank, self.ranks)
        return self._per_rank.copy()

    def on_rank(self, st: RequestState, r: int) -> np.ndarray:
        """Rank ``r``'s decoding requests, oldest first (``ids[st.rank[ids] == r]``)."""
        if self._split is None or self._split[0] != self._version:
            ranks = st.rank[self.ids]
            order = np.argsort(ranks, kind="stable")  # stable: oldest first on each rank
            ordered = self.ids[order]
            bounds = np.searchsorted(ranks[order], np.arange(self.ranks + 1)).tolist()
            self._split = (self._version, [ordered[bounds[k]:bounds[k + 1]]
                                           for k in range(self.ranks)])
        return self._split[1][r]


class SideQueues:
    """One side's dp ranks: FIFO waiting queues, one part-prefilled request per rank, the
    requests decoding. ``chunk``: prompt tokens one rank prefills per step at most."""

    def __init__(self, ranks: int, chunk: int) -> None:
        self.ranks = ranks
        self.queues: list[deque[int]] = [deque() for _ in range(ranks)]
        self.partial: list[int | None] = [None] * ranks
        self.running = Running(ranks)
        self.chunk = chunk

    def has_prompts(self, r: int) -> bool:
        return bool(self.queues[r]) or self.partial[r] is not None

    def pending(self, r: int) -> int:
        """Requests waiting or part-prefilled on rank ``r``."""
        return len(self.queues[r]) + (self.partial[r] is not None)


class EventLoop:
    """A min-heap of timed callbacks (ties in insertion order).

    ``reserve(n)`` sets aside the next ``n`` places of that order (it returns the first,
    ``base``) for callbacks known now and added later (``at(..., place=base + k)``): they tie
    as if they had been added when reserved, and the heap holds only those due next, not all of
    them at once. ``stream(times, fn)`` is that for a sorted list known whole (the client's
    arrivals): ``fn(times[k])`` in place ``base + k``, read off the list beside the heap instead
    of passing through it, in the same order.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._n = 0
        self._stream: tuple[list[float], int, Callable[[float], None]] | None = None

    def stream(self, times: list[float], fn: Callable[[float], None]) -> None:
        """``fn(t)`` at each of ``times`` (sorted), in places reserved now (one stream a loop,
        given before :meth:`run`)."""
        if self._stream is not None:
            raise ValueError("an event loop runs one stream")
        self._stream = (times, self.reserve(len(times)), fn)

    def reserve(self, n: int) -> int:
        """Set aside the next ``n`` places of the order -> the first of them."""
        base = self._n
        self._n += n
        return base

    def at(self, t: float, fn: Callable[[float], None], place: int | None = None) -> None:
        if place is None:
            place = self._n
            self._n += 1
        heapq.heappush(self._heap, (t, place, fn))

    def run(self) -> None:
        heap, pop = self._heap, heapq.heappop
        times, base, fire = self._stream or ([], 0, None)
        k, n = 0, len(times)
        while True:
            if k < n:  # the stream's next, unless the heap's first is due before it
                t = times[k]
                if not heap or t < heap[0][0] or (t == heap[0][0] and base + k < heap[0][1]):
                    k += 1
                    fire(t)
                    continue
            if not heap:
                return
            t, _, fn = pop(heap)
            fn(t)


class Client:
    """The benchmark client: issues requests, holds at most ``cap`` in flight."""

    def __init__(self, st: RequestState, req: Requests, cap: int | None, loop: EventLoop,
                 send: Callable[[int, float], None],
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.st, self.req, self.cap, self.loop, self.send_fn = st, req, cap, loop, send
        self.next = 0
        self.in_flight = 0
        self._issue = req.issue_times_s.tolist()  # Python floats, cheaper to read one by one
        # ``progress(finished, total)`` about every 1/200 of the requests, and at the end
        self.progress = progress
        self.finished_count = 0
        self._tick = max(1, len(req) // 200)
        self._next_report = self._tick

    def start(self) -> None:
        # one wake-up per distinct issue time, in the place each would have had if all were
        # added to the heap now (the loop reads them off their list: the heap stays small with
        # a million requests); pump() sends whatever is due and has a slot
        self.loop.stream(np.unique(self.req.issue_times_s).tolist(), self.pump)

    def pump(self, t: float) -> None:
        n, issue = len(self.req), self._issue
        while self.next < n and issue[self.next] <= t + 1e-12 and (
                self.cap is None or self.in_flight < self.cap):
            i = self.next
            self.next += 1
            self.in_flight += 1
            self.st.send[i] = t
            self.send_fn(i, t)

    def finished(self, ids: np.ndarray, t: float) -> None:
        if len(ids):
            self.st.done[ids] = t
            self.in_flight -= len(ids)
            self.finished_count += len(ids)
            if self.progress is not None and (self.finished_count >= self._next_report
                                              or self.finished_count == len(self.req)):
                self.progress(self.finished_count, len(self.req))
                self._next_report = self.finished_count + self._tick
            self.pump(t)
