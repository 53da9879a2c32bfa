"""The serving loop's machinery: the sides' steps, and the instances behind the routers.

    StepRecord      one step of one side (one instance of it)
    Side            one side of one instance: its queues, KV pool, scheduler and step costs
    Server          starts, costs and ends every side's steps the same way, in one event loop
    colocated_instances / disaggregated
                    build the deployment's sides and return the client's send: co-located
                    instances behind one router, or prefill instances shipping KV to decode
                    instances, a router per side (``sim/serving/router.py``)

Every instance of a deployment runs in the same event loop (``state.EventLoop``), so a
router that reads the instances' load (``least_loaded``) reads it as it is when a request is
routed; the instances share nothing else but the client and the MTP acceptance draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .config import ServingConfig
from .kv_pools import KVPool
from .loop_kernels import off_ranks, rank_batches, rank_counts
from .router import Router, make_router
from .schedulers import Counters, Scheduler, StepBatch, scheduler_class
from .speculation import DraftAcceptance
from .state import Client, EventLoop, RequestState, SideQueues, rank_mask
from .step_time import EngineStepTime, StepCost
from .tally import StepTally


@dataclass
class StepRecord:
    """One step of one side (an instance of it).

    role: the side that stepped, ``"colocated"``, ``"prefill"`` or ``"decode"``.
    start_s / seconds: when it started and how long it took.
    kind: ``"decode"`` (every active rank decodes), ``"prefill"`` (every active rank prefills)
        or ``"mixed"`` (some ranks prefill while the others decode, or, under ``decode_first``,
        a rank's batch holds both).
    decode_tokens / prefill_tokens: tokens produced / prompt tokens processed, all ranks.
    max_seqs / context: the decode batch the step was costed for (busiest rank).
    cost: the decode part's :class:`StepCost` (``None`` without decode).
    kv_usage: reserved KV share of the step's ranks at its start, after admission, in [0, 1]
        (the decode ranks', or the prefill ranks' for a disaggregated prefill step).
    rank_prefill_tokens / rank_decode_seqs: ``[ranks]`` of the side, the prompt tokens each
        rank prefilled / the sequences it decoded in this step (one or the other, except in a
        mixed batch).
    running / queued: requests admitted and not finished (holding KV) / sent and waiting for
        admission, all sides, at the step's start after admission.
    instance: the instance of its role that stepped (0 with one instance).
    rank_kv_usage / rank_running / rank_queued: ``[ranks]`` of the side at the step's start
        after admission, kept only when asked (``simulate_serving(rank_counts=True)``: a serving
        trace's per-rank counters): each rank's held KV share, the requests holding KV on it,
        and those waiting in its queue.
    """

    role: str
    start_s: float
    seconds: float
    kind: str
    decode_tokens: int
    prefill_tokens: int
    max_seqs: int
    context: int
    cost: StepCost | None
    kv_usage: float
    rank_prefill_tokens: np.ndarray | None = None
    rank_decode_seqs: np.ndarray | None = None
    running: int = 0
    queued: int = 0
    instance: int = 0
    rank_kv_usage: np.ndarray | None = None
    rank_running: np.ndarray | None = None
    rank_queued: np.ndarray | None = None




# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def _decode_batch(st: RequestState, ids: np.ndarray, ranks: int
                  ) -> tuple[int, int, np.ndarray]:
    """The decode batch a step is costed for: (max seqs on a rank, effective context, the
    ``[ranks]`` seqs on each).

    The context is the busiest rank's summed context spread over the max seqs, so both the
    per-sequence work (GEMMs, which scale with seqs) and the attention work (which scales with
    summed context) are those of the busiest rank.
    """
    seqs, ctx = rank_batches(ids, st.rank, st.isl, st.generated, ranks)
    max_seqs = max(seqs.tolist())  # Python's max: a [ranks] array is too small for numpy's
    return max_seqs, max(1, math.ceil(max(ctx.tolist()) / max_seqs)), seqs


def _add_rank_counts(record: StepRecord, side: Side) -> None:
    """Fill ``record``'s per-rank counters from ``side`` as it is now (O(requests): only when
    asked, ``Server.rank_counts``)."""
    kv, ranks = side.kv, side.queues.ranks
    record.rank_kv_usage = kv.used / kv.capacity
    record.rank_running = np.bincount(kv.rank[kv.held > 0], minlength=ranks)[:ranks]
    record.rank_queued = np.array([len(q) for q in side.queues.queues], dtype=np.int64)


def _chunk_shape(st: RequestState, items: list[tuple[int, int]]) -> tuple[int, int, int]:
    """A rank's chunk as ``seqs`` uniform sequences: (seqs, prompt, prefix) of the mean new
    tokens and prefix."""
    seqs = len(items)
    if seqs == 1:  # the usual chunk: one request's prompt, or its next part
        i, new = items[0]
        prefix = st.prefilled.item(i)
        return 1, prefix + max(1, new), prefix
    new = sum(t for _, t in items)
    prefilled = st.prefilled
    prefix = sum(prefilled.item(i) for i, _ in items)
    new_per = max(1, round(new / seqs))
    pre_per = round(prefix / seqs)
    return seqs, pre_per + new_per, pre_per


class Side:
    """One side's ranks: its queues, KV pool, scheduler and step costs (``decode`` for its
    decode batches, ``prefill`` for its chunks). ``on_prefilled(i, t)`` says what a finished
    prefill does and whether the request is done; ``kick_after`` are the sides to wake when
    one of its steps ends."""

    def __init__(self, name: str, queues: SideQueues, kv: KVPool, scheduler: Scheduler,
                 decode: EngineStepTime, prefill: EngineStepTime,
                 on_prefilled: Callable[[Side, int, float], bool], instance: int = 0) -> None:
        self.name, self.queues, self.kv, self.scheduler = name, queues, kv, scheduler
        self.instance = instance
        self.decode, self.prefill, self.on_prefilled = decode, prefill, on_prefilled
        self.busy = self.pending = False
        self.kick_after: list[Side] = [self]


class Server:
    """The loop's shared part: starts, costs and ends every side's steps the same way."""

    def __init__(self, st: RequestState, loop: EventLoop, counters: Counters,
                 spec: DraftAcceptance, keep_steps: bool = True, rank_counts: bool = False
                 ) -> None:
        self.st, self.loop, self.counters, self.spec = st, loop, counters, spec
        self.steps: list[StepRecord] = []
        self.keep_steps = keep_steps
        self.rank_counts = keep_steps and rank_counts
        self.tally = StepTally()
        self.peak = 0
        self.client: Client | None = None
        self.decode_kvs: list[KVPool] = []  # per instance, where finished requests free KV
        self.router: Router | None = None  # routes to the co-located or decode instances
        self.prefill_instance: np.ndarray | None = None

    def kick(self, side: Side, t: float) -> None:
        # start on a later callback at the same time, once every event at ``t`` has landed
        if not side.busy and not side.pending:
            side.pending = True
            self.loop.at(t, lambda t_now: self.start(side, t_now))

    def start(self, side: Side, t: float) -> None:
        side.pending = False
        if side.busy:
            return
        plan = side.scheduler.next_step()
        if plan is None:
            return
        side.busy = True
        # tokens each decoding request emits this step: 1 (``None``), plus its accepted drafts
        # under MTP
        ids = plan.decode
        counts = self.spec.tokens(self.st.osl[ids] - self.st.generated[ids]) if self.spec.drafts \
            else None
        record, peak = self.record(side, plan, t, counts)
        self.tally.add(record, peak)
        if self.keep_steps:
            if self.rank_counts:
                _add_rank_counts(record, side)
            self.steps.append(record)
        self.loop.at(t + record.seconds, lambda t_end: self.end(side, plan, t_end, counts))

    def record(self, side: Side, plan: StepBatch, t: float, counts: np.ndarray | None
               ) -> tuple[StepRecord, int]:
        """Cost ``plan``: every prefilling rank's chunk (with its decodes in a mixed batch) and
        the busiest decode-only rank; the step lasts as long as the slowest. -> the step and
        its most sequences decoding on one rank."""
        st, ranks, ids = self.st, side.queues.ranks, plan.decode
        dec_only = ids
        if plan.mixed and plan.prefill and len(ids):
            dec_only = off_ranks(ids, st.rank, rank_mask(ranks, plan.prefill))
        pre = None  # the slowest chunk (the first of equals, as max() keeps)
        for r, c in plan.prefill.items():
            cost = self._chunk_cost(side, plan, r, c)
            if pre is None or cost.seconds > pre.seconds:
                pre = cost
        dec, max_seqs, ctx, seqs = None, 0, 0, None
        if len(dec_only):
            max_seqs, ctx, seqs = _decode_batch(st, dec_only, ranks)
            dec = side.decode.decode(max_seqs, ctx, any_prefill=bool(plan.prefill))
        if seqs is None or dec_only is not ids:
            seqs = rank_counts(ids, st.rank, ranks)
        peak = max(seqs.tolist()) if len(ids) else 0
        self.peak = max(self.peak, peak)
        kind = "mixed" if (pre and len(ids)) else ("prefill" if pre else "decode")
        prompt = np.zeros(ranks, dtype=np.int64)
        chunks = np.zeros(ranks, dtype=np.int64)
        prompt_total = 0
        for r, chunk in plan.prefill.items():
            prompt[r] = rank_prompt = sum(n for _, n in chunk)
            chunks[r] = len(chunk)
            prompt_total += rank_prompt
        # the host's work grows with each rank's requests and scheduled tokens
        dt = side.decode.wall(max(pre.seconds if pre else 0.0, dec.seconds if dec else 0.0),
                              seqs + chunks, seqs + prompt)
        tokens = len(ids) if counts is None else int(counts.sum())
        return StepRecord(side.name, t, dt, kind, tokens, prompt_total,
                          max_seqs, ctx, dec, side.kv.usage(), prompt, seqs, **self.counts(),
                          instance=side.instance), peak

    def _chunk_cost(self, side: Side, plan: StepBatch, r: int, chunk: list[tuple[int, int]]
                    ) -> StepCost:
        shape = _chunk_shape(self.st, chunk)
        if plan.mixed and len(plan.decode):
            mine = plan.decode[self.st.rank[plan.decode] == r]
            if len(mine):
                _, ctx, _ = _decode_batch(self.st, mine, side.queues.ranks)
                return side.prefill.mixed(*shape, len(mine), ctx)
        return side.prefill.prefill(*shape)

    def end(self, side: Side, plan: StepBatch, t: float, counts: np.ndarray | None) -> None:
        st, q = self.st, side.queues
        done = st.emit(plan.decode, t, counts, side.instance) if len(plan.decode) \
            else plan.decode
        if counts is not None:
            side.kv.settle(plan.decode, counts)  # rejected drafts give their slots back
        q.running.remove(done)
        also_done = []
        for r, items in plan.prefill.items():
            q.partial[r] = None
            for i, n in items:
                done_tokens = st.prefilled.item(i) + n
                st.prefilled[i] = done_tokens
                if done_tokens < st.isl.item(i) + st.generated.item(i):  # prefill_target(i)
                    q.partial[r] = i
                elif side.on_prefilled(side, i, t):
                    also_done.append(i)
        side.busy = False
        self.finish(np.concatenate([done, np.array(also_done, dtype=np.int64)]), t)
        for other in side.kick_after:
            self.kick(other, t)

    def token_after_prefill(self, side: Side, i: int, t: float) -> bool:
        """A prefill (or a preempted request's recompute) ended: its first token, or its next
        one; True when that was its last."""
        st = self.st
        if st.generated[i] == 0:
            st.first[i] = st.last[i] = t
            st.generated[i] = 1
            st.gaps.first_tokens(t, 1)
        else:
            st.emit(np.array([i], dtype=np.int64), t, instance=side.instance)
        if st.generated[i] >= st.osl[i]:
            return True
        side.queues.running.add(i)
        return False

    def finish(self, ids: np.ndarray, t: float) -> None:
        if len(ids):
            if len(self.decode_kvs) == 1:  # one instance: every request is its own
                self.decode_kvs[0].release(ids)
                self.router.done_at_one(len(ids))
            else:
                owner = self.st.owner[ids]
                for k in np.unique(owner):
                    self.decode_kvs[k].release(ids[owner == k])
                self.router.done(owner)
            self.client.finished(ids, t)

    def counts(self) -> dict[str, int]:
        """Requests holding KV (admitted, not finished) and sent but not admitted."""
        sent, in_flight = self.client.next, self.client.in_flight
        admitted = self.counters.admitted
        return {"running": admitted - (sent - in_flight), "queued": sent - admitted}


def _colocated(server: Server, config: ServingConfig, decode: EngineStepTime,
               prefill: EngineStepTime, k: int = 0) -> Callable[[int, float], None]:
    """Instance ``k``: one side that prefills and decodes under ``config.scheduler`` -> its
    send (a request routed to it goes to one of its dp ranks)."""
    st, dp = server.st, config.dp
    cls = scheduler_class(config.scheduler)
    q = SideQueues(dp, config.chunked_prefill_size)
    kv = cls.make_kv(dp, config.kv_capacity_tokens, st, st.rank, config)
    kv.lookahead = config.mtp
    side = Side("colocated", q, kv, cls(q, st, kv, config, server.counters), decode, prefill,
                 server.token_after_prefill, k)
    server.decode_kvs.append(kv)
    dispatcher = make_router(config.dp_balance, dp, lambda r: q.pending(r) + int(
        np.count_nonzero(st.rank[q.running.ids] == r)))

    def send(i: int, t: float) -> None:
        r = dispatcher.route()
        st.rank[i] = r
        q.queues[r].append(i)
        server.kick(side, t)

    return send


def colocated_instances(server: Server, config: ServingConfig, decode: EngineStepTime,
                         prefill: EngineStepTime) -> Callable[[int, float], None]:
    """``config.instances`` co-located instances behind the router -> the client's send."""
    sends = [_colocated(server, config, decode, prefill, k) for k in range(config.instances)]
    server.router = router = make_router(config.router, config.instances)

    def send(i: int, t: float) -> None:
        k = router.route()
        server.st.owner[i] = k
        sends[k](i, t)

    return send


def _decode_instances(server: Server, config: ServingConfig, decode: EngineStepTime
                      ) -> tuple[list[Side], list[Router]]:
    """The disaggregated decode side's instances and their dp-rank dispatchers."""
    st, dp, cls = server.st, config.dp, scheduler_class("disagg_decode")
    sides, dispatch = [], []
    for k in range(config.instances):
        q = SideQueues(dp, config.chunked_prefill_size)
        kv = cls.make_kv(dp, config.kv_capacity_tokens, st, st.rank, config)
        kv.lookahead = config.mtp
        sides.append(Side("decode", q, kv, cls(q, st, kv, config, server.counters), decode,
                           decode, server.token_after_prefill, k))
        server.decode_kvs.append(kv)
        dispatch.append(make_router(config.dp_balance, dp,
                                    lambda r, kv=kv: int(kv.used[r])))
    return sides, dispatch


def disaggregated(server: Server, config: ServingConfig, decode: EngineStepTime,
                   prefill: EngineStepTime) -> Callable[[int, float], None]:
    """Prefill instances that ship each prompt's KV to decode instances -> the client's send.

    Both routers pick when the request is sent: its decode instance (and rank) must be known
    before the prefill starts, since its KV is reserved there first (as SGLang with Mooncake
    pre-allocates)."""
    st, pdp = server.st, config.prefill_dp
    n = len(st.isl)
    prank = np.full(n, -1, dtype=np.int64)
    server.prefill_instance = pinst = np.full(n, -1, dtype=np.int64)
    pcls = scheduler_class("disagg_prefill")
    dsides, ddispatch = _decode_instances(server, config, decode)
    prouter = make_router(config.router, config.prefill_instances)
    server.router = drouter = make_router(config.router, config.instances)

    def transferred(t: float, i: int) -> None:
        pside, dside = psides[pinst[i]], dsides[st.owner[i]]
        pside.kv.release(np.array([i], dtype=np.int64))
        prouter.done(pinst[[i]])
        if server.token_after_prefill(dside, i, t):
            server.finish(np.array([i], dtype=np.int64), t)
        else:
            server.kick(dside, t)
        server.kick(pside, t)

    def ship(side: Side, i: int, t: float) -> bool:
        arrive = t + config.kv_transfer_latency_s \
            + config.kv_transfer_s_per_token * float(st.isl[i])
        server.loop.at(arrive, lambda t_arr: transferred(t_arr, i))
        return False

    def decode_kv(i: int) -> KVPool:
        return server.decode_kvs[st.owner[i]]

    psides, pdispatch = [], []
    for k in range(config.prefill_instances):
        pq = SideQueues(pdp, config.chunked_prefill_size)
        pkv = pcls.make_kv(pdp, config.prefill_kv_capacity_tokens, st, prank, config)
        sched = pcls(pq, st, pkv, config, server.counters, decode_kv=decode_kv)
        psides.append(Side("prefill", pq, pkv, sched, prefill, prefill, ship, k))
        pdispatch.append(make_router(config.dp_balance, pdp, lambda r, q=pq: q.pending(r)))
    for dside in dsides:
        dside.kick_after = [*psides, dside]  # freed decode KV may admit prefills

    def send(i: int, t: float) -> None:
        p, d = prouter.route(), drouter.route()
        pinst[i], st.owner[i] = p, d
        prank[i] = pdispatch[p].route()
        st.rank[i] = ddispatch[d].route()
        psides[p].queues.queues[prank[i]].append(i)
        server.kick(psides[p], t)

    return send


