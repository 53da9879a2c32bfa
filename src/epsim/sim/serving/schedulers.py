"""The serving loop's schedulers: one class per policy, each answering "what runs next".

Modelled on Vidur's replica schedulers (microsoft/vidur, ``vidur/scheduler/replica_scheduler/``:
one class per engine behind a registry, each with ``_get_next_batch``). Here a scheduler owns
one side's dp ranks (the co-located engine, or one side of a disaggregated deployment);
:meth:`Scheduler.next_step` admits, preempts and returns a :class:`StepBatch`: per rank the
prompt chunk it prefills and the requests it decodes. The loop (``sim/serving/simulate.py``) costs the
plan, and when the step ends advances the chunks and emits the tokens, the same for every
policy. With DP attention and EP every rank steps together (the MoE all-to-all synchronises
them), so a plan covers every rank of the side.

    prefill_first   epsim's own policy (the default without ``--engine``): a rank holding
                    prompts prefills a chunk instead of decoding, the other ranks decode in the
                    same step; whole sequences reserved at admission, never preempted
    sglang          SGLang's scheduler with DP attention (sglang 0.5.23,
                    ``srt/managers/scheduler.py``: a new prefill batch runs before the running
                    batch decodes; ``schedule_policy.py``: ``PrefillAdder``): prefill first as
                    above, at most ``max_running_requests`` per rank, KV admitted by reservation
                    and retracted when a decode does not fit; with mixed chunking
                    (``enable_mixed_chunk``) a prefilling rank's running requests decode in the
                    same batch
    decode_first    vLLM V1's scheduler (vllm 0.33.0, ``vllm/v1/core/sched/scheduler.py``,
                    ``Scheduler.schedule``): running requests first (each decode one token, a
                    part-prefilled prompt its next chunk), then waiting requests, all under the
                    token budget ``max_num_batched_tokens`` and ``max_num_seqs``; prefill chunks
                    and decodes share the rank's batch; KV allocated as computed, the newest
                    requests preempted (recomputed later) when slots run out
    split           separate prefill and decode queues (the reference report's modified vLLM):
                    a step prefills on every rank holding prompts, or else decodes on every
                    rank, never both; vLLM's caps and KV allocation
    disagg_prefill  the prefill side of a disaggregated deployment: chunks only; a request is
                    admitted when its prompt fits here and its whole sequence on its decode rank
    disagg_decode   the decode side: every request whose KV has arrived decodes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .config import ServingConfig
from .kv_pools import KVPool, Paged, Reservation, WholeSequence
from .loop_kernels import off_ranks
from .state import RequestState, SideQueues, rank_mask

#: one rank's prompt chunk: ``[(request, tokens)]``
Chunk = list[tuple[int, int]]


@dataclass
class StepBatch:
    """What runs in one step of a side.

    prefill: rank -> its chunk (only ranks that prefill).
    decode: the requests that decode one token (all ranks).
    mixed: a prefilling rank's decodes run in the same batch as its chunk (vLLM; SGLang with
        mixed chunking); otherwise a rank prefills or decodes, not both.
    """

    prefill: dict[int, Chunk]
    decode: np.ndarray
    mixed: bool = False


@dataclass
class Counters:
    """Shared by every side of a run: requests holding KV (admitted, not finished, not
    preempted) and preemptions (vLLM) or retractions (SGLang) so far."""

    admitted: int = 0
    preemptions: int = 0


class Scheduler:
    """One policy over one side's ranks. Subclasses set ``name``, ``summary``, ``kv_pool`` and
    implement :meth:`next_step`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    kv_pool: ClassVar[type[KVPool]] = WholeSequence

    def __init__(self, side: SideQueues, st: RequestState, kv: KVPool, config: ServingConfig,
                 counters: Counters, **_: Any) -> None:
        self.side, self.st, self.kv, self.config, self.counters = side, st, kv, config, counters

    @classmethod
    def make_kv(cls, ranks: int, capacity: int, st: RequestState, rank: np.ndarray,
                config: ServingConfig) -> KVPool:
        """This policy's KV pool for a side of ``ranks`` ranks."""
        return cls.kv_pool(ranks, capacity, st, rank)

    def next_step(self) -> StepBatch | None:
        """Admit, preempt and say what every rank runs next (``None``: nothing to run)."""
        raise NotImplementedError

    # shared pieces ------------------------------------------------------------------------

    def running_cap(self) -> int | None:
        return self.config.max_running_per_rank

    def admitted_on(self, r: int, chunk: Chunk) -> np.ndarray:
        """Rank ``r``'s admitted requests: decoding, part-prefilled, and in ``chunk``."""
        side = self.side
        extra = [i for i, _ in chunk]
        if side.partial[r] is not None and side.partial[r] not in extra:
            extra.append(side.partial[r])
        return np.concatenate([side.running.on_rank(self.st, r),
                               np.array(extra, dtype=np.int64)])

    def form_chunk(self, r: int, budget: int, running: int = 0,
                   admit: Callable[[int, int, int, Chunk], bool] | None = None) -> Chunk:
        """Rank ``r``'s next chunk within ``budget`` tokens: the part-prefilled request first,
        then queued ones in FIFO order while ``admit`` takes their KV and the running cap
        (``running`` requests on the rank already) allows. Head-of-line: the first that
        cannot be admitted stops the admission, so no request overtakes another."""
        st, side = self.st, self.side
        admit = admit or self.admit
        cap = self.running_cap()
        items: Chunk = []
        p = side.partial[r]
        if p is not None:
            take = int(min(st.prefill_left(p), budget))
            if not self.kv.extend(r, p, take):
                return items
            items.append((p, take))
            budget -= take
        q = side.queues[r]
        while budget > 0 and q:
            if cap is not None and running + len(items) >= cap:
                break
            head = q[0]
            take = int(min(st.prefill_left(head), budget))
            if not admit(r, head, take, items):
                break
            q.popleft()
            items.append((head, take))
            budget -= take
        return items

    def admit(self, r: int, i: int, tokens: int, chunk: Chunk) -> bool:
        if not self.kv.admit(r, i, tokens, lambda: self.admitted_on(r, chunk)):
            return False
        self.counters.admitted += 1
        return True

    def take_back(self, r: int, i: int, *, front: bool) -> None:
        """Free request ``i``'s KV; it waits again (at the queue's front or back) and will
        recompute its prompt and the tokens it had (``RequestState.prefill_target``)."""
        side, st = self.side, self.st
        self.kv.release(np.array([i], dtype=np.int64))
        if side.partial[r] == i:
            side.partial[r] = None
        else:
            side.running.remove(np.array([i], dtype=np.int64))
        st.prefilled[i] = 0
        st.preemptions[i] += 1
        self.counters.admitted -= 1
        self.counters.preemptions += 1
        if front:
            side.queues[r].appendleft(i)
        else:
            side.queues[r].append(i)


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

SCHEDULERS: dict[str, type[Scheduler]] = {}


def register(cls: type[Scheduler]) -> type[Scheduler]:
    SCHEDULERS[cls.name] = cls
    return cls


def scheduler_class(name: str) -> type[Scheduler]:
    """The registered scheduler ``name`` (KeyError names the known ones)."""
    if name not in SCHEDULERS:
        raise KeyError(f"unknown scheduler {name!r} (one of {', '.join(SCHEDULERS)})")
    return SCHEDULERS[name]


@register
class PrefillFirst(Scheduler):
    name = "prefill_first"
    summary = ("a rank holding prompts prefills a chunk (up to chunked_prefill_size tokens) "
               "instead of decoding; the other ranks decode in the same step; whole sequences "
               "reserved at admission")

    def chunks(self) -> dict[int, Chunk]:
        side = self.side
        prompted = [r for r in range(side.ranks) if side.has_prompts(r)]
        if not prompted:
            return {}
        count = side.running.count(self.st).tolist()
        return {r: c for r in prompted for c in [self.form_chunk(r, side.chunk, count[r])] if c}

    def decodes(self, chunks: dict[int, Chunk]) -> np.ndarray:
        ids = self.side.running.ids
        if chunks and len(ids) and not self.mixed():
            ids = off_ranks(ids, self.st.rank, rank_mask(self.side.ranks, chunks))
        return ids

    def mixed(self) -> bool:
        return False

    def next_step(self) -> StepBatch | None:
        self.side.running.flush()
        chunks = self.chunks()
        ids = self.decodes(chunks)
        if not chunks and not len(ids):
            return None
        return StepBatch(chunks, ids, self.mixed())


@register
class Sglang(PrefillFirst):
    name = "sglang"
    summary = ("SGLang: prefill batches before decode (mixed into the decode batch with "
               "enable_mixed_chunk); max_running_requests per rank; KV admitted by reservation "
               "(remaining prompt + min(remaining output, 4096)), retracted when a decode step "
               "does not fit")
    kv_pool = Reservation

    @classmethod
    def make_kv(cls, ranks: int, capacity: int, st: RequestState, rank: np.ndarray,
                config: ServingConfig) -> KVPool:
        return Reservation(ranks, capacity, st, rank, clip=config.reserve_clip_tokens)

    def mixed(self) -> bool:
        return self.config.mixed_chunk

    def chunks(self) -> dict[int, Chunk]:
        # the chunk is also bounded by max_prefill_tokens; a mixed batch's decodes take their
        # share of it (PrefillAdder's num_mixed_decode_tokens)
        side, count = self.side, self.side.running.count(self.st)
        top = min(side.chunk, self.config.max_batched_tokens or side.chunk)
        out = {}
        for r in range(side.ranks):
            budget = top - (int(count[r]) if self.mixed() else 0)
            if side.has_prompts(r) and budget > 0:
                chunk = self.form_chunk(r, budget, int(count[r]))
                if chunk:
                    out[r] = chunk
        return out

    def decodes(self, chunks: dict[int, Chunk]) -> np.ndarray:
        ids = super().decodes(chunks)
        for r in np.unique(self.st.rank[ids]):
            self.retract(int(r))
        return super().decodes(chunks)

    def retract(self, r: int) -> None:
        """SGLang's ``retract_decode``: while rank ``r``'s decodes do not fit, retract the
        request with the fewest output tokens (the longest prompt among equals), keeping one;
        retracted requests wait at the back of the queue."""
        st = self.st
        ids = self.side.running.on_rank(st, r)
        if self.kv.grow(r, ids):
            return
        order = sorted(ids.tolist(), key=lambda i: (st.generated[i], -st.isl[i]), reverse=True)
        while len(order) > 1:
            self.take_back(r, order.pop(), front=False)
            if self.kv.grow(r, np.array(order, dtype=np.int64)):
                return
        raise AssertionError("one request's next token does not fit its rank's KV cache")


class _VllmKV(Scheduler):
    """vLLM's KV handling: slots as computed, the newest request preempted when they run out."""

    kv_pool = Paged

    def running_cap(self) -> int | None:
        return self.config.max_running_per_rank

    def budget(self) -> int:
        return self.config.max_batched_tokens or self.side.chunk

    def grow_or_preempt(self, r: int) -> np.ndarray:
        """Slots for rank ``r``'s decodes, preempting the newest requests (a part-prefilled one
        first: it was admitted last) until they fit -> the rank's decoding requests."""
        st, side = self.st, self.side
        ids = side.running.on_rank(st, r)
        while not self.kv.grow(r, ids):
            if side.partial[r] is not None:
                self.take_back(r, side.partial[r], front=True)
                continue
            self.take_back(r, int(ids[-1]), front=True)
            ids = ids[:-1]
        return ids


@register
class DecodeFirst(_VllmKV):
    name = "decode_first"
    summary = ("vLLM V1: running requests first (decodes, then a part-prefilled prompt's next "
               "chunk), then waiting ones, under max_num_batched_tokens and max_num_seqs per "
               "rank; chunks and decodes in one batch; newest preempted when KV runs out")

    def next_step(self) -> StepBatch | None:
        side = self.side
        side.running.flush()
        chunks: dict[int, Chunk] = {}
        decode: list[np.ndarray] = []
        count = side.running.count(self.st)
        for r in range(side.ranks):
            if not count[r] and not side.has_prompts(r):
                continue  # an idle rank: nothing to grow, nothing to admit
            before = self.counters.preemptions
            ids = self.grow_or_preempt(r)
            decode.append(ids)
            budget = min(self.budget() - len(ids), side.chunk)
            if budget <= 0 or not side.has_prompts(r):
                continue
            if self.counters.preemptions != before:
                # vLLM admits no waiting request in a step that preempted; a part-prefilled
                # one (still running) goes on
                chunk = self._continue_partial(r, budget)
            else:
                chunk = self.form_chunk(r, budget, len(ids))
            if chunk:
                chunks[r] = chunk
        ids = np.concatenate(decode) if decode else np.zeros(0, dtype=np.int64)
        if not chunks and not len(ids):
            return None
        return StepBatch(chunks, ids, mixed=True)

    def _continue_partial(self, r: int, budget: int) -> Chunk:
        p = self.side.partial[r]
        if p is None:
            return []
        take = int(min(self.st.prefill_left(p), budget))
        if not self.kv.extend(r, p, take):
            self.take_back(r, p, front=True)
            return []
        return [(p, take)]


@register
class Split(_VllmKV):
    name = "split"
    summary = ("separate prefill and decode queues (the reference report's modified vLLM): a "
               "step prefills on every rank holding prompts, or else decodes on every rank; "
               "vLLM's caps and KV allocation")

    def next_step(self) -> StepBatch | None:
        side, st = self.side, self.st
        side.running.flush()
        count = side.running.count(st)
        chunks = {r: c for r in range(side.ranks) if side.has_prompts(r)
                  for c in [self.form_chunk(r, self.budget(), int(count[r]))] if c}
        if chunks:
            return StepBatch(chunks, np.zeros(0, dtype=np.int64))
        ids = [self.grow_or_preempt(r) for r in range(side.ranks)]
        ids = np.concatenate(ids)
        return StepBatch({}, ids) if len(ids) else None


@register
class DisaggPrefill(Scheduler):
    name = "disagg_prefill"
    summary = ("the prefill side of a disaggregated deployment: chunks of chunked_prefill_size "
               "tokens; admitted when the prompt fits here and the whole sequence on the "
               "request's decode rank (its KV pre-allocated there)")

    def __init__(self, side: SideQueues, st: RequestState, kv: KVPool, config: ServingConfig,
                 counters: Counters, *, decode_kv: Callable[[int], KVPool] | None = None,
                 **kw: Any) -> None:
        super().__init__(side, st, kv, config, counters)
        assert decode_kv is not None, "the prefill side admits against the decode side's KV"
        #: request -> the KV pool of the decode instance it was routed to
        self.decode_kv = decode_kv

    @classmethod
    def make_kv(cls, ranks: int, capacity: int, st: RequestState, rank: np.ndarray,
                config: ServingConfig) -> KVPool:
        return WholeSequence(ranks, capacity, st, rank, need=lambda i: int(st.isl[i]))

    def admit(self, r: int, i: int, tokens: int, chunk: Chunk) -> bool:
        d, dkv = int(self.st.rank[i]), self.decode_kv(i)
        if not (self.kv.fits(r, int(self.st.isl[i])) and dkv.fits(d, dkv.need(i))):
            return False
        self.kv.admit(r, i, tokens, lambda: chunk)
        dkv.admit(d, i, tokens, lambda: chunk)
        self.counters.admitted += 1
        return True

    def next_step(self) -> StepBatch | None:
        side = self.side
        chunks = {r: c for r in range(side.ranks) if side.has_prompts(r)
                  for c in [self.form_chunk(r, side.chunk)] if c}
        return StepBatch(chunks, np.zeros(0, dtype=np.int64)) if chunks else None

    def running_cap(self) -> int | None:
        return None  # the decode side's cap is its KV


@register
class DisaggDecode(Scheduler):
    name = "disagg_decode"
    summary = "the decode side of a disaggregated deployment: every request whose KV arrived"

    def next_step(self) -> StepBatch | None:
        self.side.running.flush()
        ids = self.side.running.ids
        return StepBatch({}, ids) if len(ids) else None
