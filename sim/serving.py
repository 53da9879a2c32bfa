"""The serving simulation: a benchmark client against continuous-batching DP ranks.

What is simulated (event by event, one event per step of each side, not per token):

    client       sends each request at ``max(issue time, a free concurrency slot)``; a request's
                 clock (TTFT, E2E latency) starts when it is sent, as in ``vllm bench serve``.
    dispatch     a sent request goes to one dp rank, round robin (SGLang's DP-attention default)
                 or to the least loaded one; it waits in that rank's FIFO queue.
    sides        a co-located deployment has one side (its ranks prefill and decode); a
                 disaggregated one a prefill side (its own nodes) and a decode side. Every rank
                 of a side steps together (the MoE all-to-all synchronises them), so a step
                 lasts as long as its busiest rank needs.
    scheduler    each side's scheduler (``sim/schedulers.py``, a registry of policies) answers
                 what runs in the next step: which prompt chunks, which decodes, which requests
                 are admitted into the KV cache (``sim/kv_admission.py``) or preempted.
    steps        the loop costs the plan (``sim/step_time.py``), and when the step ends
                 advances the chunks and emits the tokens, the same for every policy. A prompt
                 whose prefill ends gives its first token (co-located), or ships its KV cache
                 over the NIC to its decode rank (disaggregated: the decode rank's KV was
                 reserved before the prefill started, as SGLang/Mooncake pre-allocate; the first
                 token reaches the client when the KV has arrived). A preempted request's
                 recompute ends with its next token instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from epsim.model.errors import EpsimError
from epsim.model.mtp import DEFAULT_ACCEPTANCE, check_acceptance

from .kv_admission import SGLANG_CLIP_MAX_NEW_TOKENS, KVPool
from .schedulers import COLOCATED, SCHEDULERS, Counters, Scheduler, StepPlan, scheduler_class
from .serving_state import Client, Dispatcher, EventLoop, RequestState, SideQueues
from .speculation import DraftAcceptance
from .step_time import (  # noqa: F401  (re-exported: the step-time names' old home)
    GRID_EXACT,
    EngineStepTime,
    MemoStepTime,
    SimulatedStepTime,
    StepCost,
    StepPolicy,
    StepTimeModel,
    grid_bracket,
    grid_nearest,
    mix_costs,
)
from .workload import Requests

DP_BALANCE = ("round_robin", "least_loaded")


# --------------------------------------------------------------------------------------------
# Configuration and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingConfig:
    """One deployment's (one instance's) scheduling parameters.

    dp: decode-side dp ranks (co-located: all ranks). Example: 8.
    kv_capacity_tokens: KV-cache tokens one decode rank holds (``memory_budget``). Example:
        1_925_783 (DeepSeek-R1, DP8/EP8, MI300X, FP8 KV).
    chunked_prefill_size: prompt tokens one rank prefills per step at most. Example: 8192.
    dp_balance: ``"round_robin"`` or ``"least_loaded"`` (fewest requests queued or running).
    prefill_dp: disaggregated: prefill ranks (``None``: prefill co-located with decode).
    prefill_kv_capacity_tokens: disaggregated: KV tokens one prefill rank holds.
    kv_transfer_s_per_token: disaggregated: seconds to ship one prompt token's KV over the NIC.
    kv_transfer_latency_s: disaggregated: fixed cost per transfer (handshake).
    scheduler: the co-located policy (``sim/schedulers.py``: ``prefill_first``, ``sglang``,
        ``decode_first``, ``split``); a disaggregated deployment runs ``disagg_prefill`` and
        ``disagg_decode``. Example: ``"decode_first"``.
    max_running_per_rank: requests one rank holds in its running batch at most (vLLM's
        ``max_num_seqs``, SGLang's ``max_running_requests`` per DP rank; ``None``: no cap).
    max_batched_tokens: tokens one rank's step holds at most, decodes included (vLLM's
        ``max_num_batched_tokens``; ``None``: ``chunked_prefill_size``).
    mixed_chunk: ``sglang``: a prefilling rank's running requests decode in the same batch
        (SGLang's ``enable_mixed_chunk``).
    reserve_clip_tokens: ``sglang``: output tokens a request is expected to need at most
        (SGLang's ``CLIP_MAX_NEW_TOKENS``).
    mtp / mtp_acceptance: MTP speculative decoding: draft tokens verified per decode step and
        each one's acceptance probability (``epsim.sim.speculation``); 0: off. The KV pools hold
        ``mtp`` draft slots per decoding request beyond its tokens.
    seed: seeds the acceptance draws.
    """

    dp: int
    kv_capacity_tokens: int
    chunked_prefill_size: int = 8192
    dp_balance: str = "round_robin"
    prefill_dp: int | None = None
    prefill_kv_capacity_tokens: int | None = None
    kv_transfer_s_per_token: float = 0.0
    kv_transfer_latency_s: float = 0.0
    scheduler: str = "prefill_first"
    mtp: int = 0
    mtp_acceptance: float = DEFAULT_ACCEPTANCE
    seed: int = 0
    max_running_per_rank: int | None = None
    max_batched_tokens: int | None = None
    mixed_chunk: bool = False
    reserve_clip_tokens: int = SGLANG_CLIP_MAX_NEW_TOKENS

    @property
    def disaggregated(self) -> bool:
        return self.prefill_dp is not None

    def validate(self) -> ServingConfig:
        if self.dp < 1:
            raise EpsimError(f"dp must be a positive integer, got {self.dp}")
        if self.kv_capacity_tokens < 1:
            raise EpsimError(f"KV capacity must be positive, got {self.kv_capacity_tokens} tokens")
        if self.chunked_prefill_size < 1:
            raise EpsimError(f"chunked-prefill-size must be positive, got "
                             f"{self.chunked_prefill_size}")
        if self.dp_balance not in DP_BALANCE:
            raise EpsimError(f"dp balance must be one of {', '.join(DP_BALANCE)}, "
                             f"got {self.dp_balance!r}")
        if self.scheduler not in COLOCATED:
            raise EpsimError(f"scheduler must be one of {', '.join(COLOCATED)}, "
                             f"got {self.scheduler!r}")
        if self.mtp < 0:
            raise EpsimError(f"mtp must be 0 or more draft tokens, got {self.mtp}")
        check_acceptance(self.mtp_acceptance)
        for name in ("max_running_per_rank", "max_batched_tokens", "reserve_clip_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EpsimError(f"{name.replace('_', '-')} must be positive, got {value}")
        if self.disaggregated:
            if self.prefill_dp < 1 or not self.prefill_kv_capacity_tokens \
                    or self.prefill_kv_capacity_tokens < 1:
                raise EpsimError("disaggregated serving needs prefill ranks with a KV cache")
        return self


@dataclass
class StepRecord:
    """One step of one engine.

    engine: ``"colocated"``, ``"prefill"`` or ``"decode"``.
    start_s / seconds: when it started and how long it took.
    kind: ``"decode"`` (every active rank decodes), ``"prefill"`` (every active rank prefills)
        or ``"mixed"`` (some ranks prefill while the others decode, or, under ``decode_first``,
        a rank's batch holds both).
    decode_tokens / prefill_tokens: tokens produced / prompt tokens processed, all ranks.
    max_seqs / context: the decode batch the step was costed for (busiest rank).
    cost: the decode part's :class:`StepCost` (``None`` without decode).
    kv_usage: reserved KV share of the step's ranks at its start, after admission, in [0, 1]
        (the decode ranks', or the prefill ranks' for a disaggregated prefill step).
    rank_prefill_tokens / rank_decode_seqs: ``[ranks]`` of the engine, the prompt tokens each
        rank prefilled / the sequences it decoded in this step (one or the other, except in a
        mixed batch).
    running / queued: requests admitted and not finished (holding KV) / sent and waiting for
        admission, all engines, at the step's start after admission.
    """

    engine: str
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


@dataclass
class ServingRun:
    """Everything a benchmark run produced (arrays indexed by request id).

    requests: what was sent.
    send_s / first_token_s / done_s: per request, in seconds from the start.
    itls_s: every inter-token gap of every request, pooled (vLLM's ITL population).
    itl_request_ids: the request of each gap of ``itls_s`` (its per-request lists, in time order).
    steps: every engine step.
    sim_calls: exact step-time evaluations this run made (memo misses).
    max_running_per_rank: the most requests one rank decoded in one step.
    speculation: under MTP, vLLM's ``spec_decode_*`` counters (``epsim.sim.speculation``);
        empty otherwise.
    preemptions: times a request's KV was taken back (vLLM's preemption, SGLang's
        retraction) to be recomputed later.
    """

    requests: Requests
    send_s: np.ndarray
    first_token_s: np.ndarray
    done_s: np.ndarray
    itls_s: np.ndarray
    steps: list[StepRecord]
    config: ServingConfig
    sim_calls: int = 0
    max_running_per_rank: int = 0
    preemptions: int = 0
    speculation: dict[str, Any] = field(default_factory=dict)
    itl_request_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))




# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def _decode_batch(st: RequestState, ids: np.ndarray, ranks: int) -> tuple[int, int]:
    """The decode batch a step is costed for: (max seqs on a rank, effective context).

    The context is the busiest rank's summed context spread over the max seqs, so both the
    per-sequence work (GEMMs, which scale with seqs) and the attention work (which scales with
    summed context) are those of the busiest rank.
    """
    r = st.rank[ids]
    seqs = np.bincount(r, minlength=ranks)
    ctx = np.bincount(r, weights=(st.isl[ids] + st.generated[ids]).astype(np.float64),
                      minlength=ranks)
    max_seqs = int(seqs.max())
    return max_seqs, max(1, math.ceil(float(ctx.max()) / max_seqs))


def _chunk_shape(st: RequestState, items: list[tuple[int, int]]) -> tuple[int, int, int]:
    """A rank's chunk as ``seqs`` uniform sequences: (seqs, prompt, prefix) of the mean new
    tokens and prefix."""
    seqs = len(items)
    new = sum(t for _, t in items)
    prefix = sum(int(st.prefilled[i]) for i, _ in items)
    new_per = max(1, round(new / seqs))
    pre_per = round(prefix / seqs)
    return seqs, pre_per + new_per, pre_per


class _Side:
    """One side's ranks: its queues, KV pool, scheduler and step costs (``decode`` for its
    decode batches, ``prefill`` for its chunks). ``on_prefilled(i, t)`` says what a finished
    prefill does and whether the request is done; ``kick_after`` are the sides to wake when
    one of its steps ends."""

    def __init__(self, name: str, queues: SideQueues, kv: KVPool, scheduler: Scheduler,
                 decode: EngineStepTime, prefill: EngineStepTime,
                 on_prefilled: Callable[[_Side, int, float], bool]) -> None:
        self.name, self.queues, self.kv, self.scheduler = name, queues, kv, scheduler
        self.decode, self.prefill, self.on_prefilled = decode, prefill, on_prefilled
        self.busy = self.pending = False
        self.kick_after: list[_Side] = [self]


class _Server:
    """The loop's shared part: starts, costs and ends every side's steps the same way."""

    def __init__(self, st: RequestState, loop: EventLoop, counters: Counters,
                 spec: DraftAcceptance) -> None:
        self.st, self.loop, self.counters, self.spec = st, loop, counters, spec
        self.steps: list[StepRecord] = []
        self.peak = 0
        self.client: Client | None = None
        self.decode_kv: KVPool | None = None  # where finished requests free their KV

    def kick(self, side: _Side, t: float) -> None:
        # start on a later callback at the same time, once every event at ``t`` has landed
        if not side.busy and not side.pending:
            side.pending = True
            self.loop.at(t, lambda t_now: self.start(side, t_now))

    def start(self, side: _Side, t: float) -> None:
        side.pending = False
        if side.busy:
            return
        plan = side.scheduler.next_step()
        if plan is None:
            return
        side.busy = True
        # tokens each decoding request emits this step: 1, plus its accepted drafts under MTP
        counts = self.spec.tokens(self.st.osl[plan.decode] - self.st.generated[plan.decode])
        record = self.record(side, plan, t, counts)
        self.steps.append(record)
        self.loop.at(t + record.seconds, lambda t_end: self.end(side, plan, t_end, counts))

    def record(self, side: _Side, plan: StepPlan, t: float, counts: np.ndarray) -> StepRecord:
        """Cost ``plan``: every prefilling rank's chunk (with its decodes in a mixed batch) and
        the busiest decode-only rank; the step lasts as long as the slowest."""
        st, ranks, ids = self.st, side.queues.ranks, plan.decode
        dec_only = ids
        if plan.mixed and plan.prefill and len(ids):
            dec_only = ids[~np.isin(st.rank[ids], list(plan.prefill))]
        pre = max((self._chunk_cost(side, plan, r, c) for r, c in plan.prefill.items()),
                  key=lambda c: c.seconds, default=None)
        dec, max_seqs, ctx = None, 0, 0
        if len(dec_only):
            max_seqs, ctx = _decode_batch(st, dec_only, ranks)
            dec = side.decode.decode(max_seqs, ctx, any_prefill=bool(plan.prefill))
        seqs = np.bincount(st.rank[ids], minlength=ranks) if len(ids) \
            else np.zeros(ranks, dtype=np.int64)
        if len(ids):
            self.peak = max(self.peak, int(seqs.max()))
        dt = side.decode.wall(max(pre.seconds if pre else 0.0, dec.seconds if dec else 0.0))
        kind = "mixed" if (pre and len(ids)) else ("prefill" if pre else "decode")
        prompt = np.zeros(ranks, dtype=np.int64)
        for r, chunk in plan.prefill.items():
            prompt[r] = sum(n for _, n in chunk)
        return StepRecord(side.name, t, dt, kind, int(counts.sum()), int(prompt.sum()),
                          max_seqs, ctx, dec, side.kv.usage(), prompt, seqs, **self.counts())

    def _chunk_cost(self, side: _Side, plan: StepPlan, r: int, chunk: list[tuple[int, int]]
                    ) -> StepCost:
        shape = _chunk_shape(self.st, chunk)
        if plan.mixed and len(plan.decode):
            mine = plan.decode[self.st.rank[plan.decode] == r]
            if len(mine):
                _, ctx = _decode_batch(self.st, mine, side.queues.ranks)
                return side.prefill.mixed(*shape, len(mine), ctx)
        return side.prefill.prefill(*shape)

    def end(self, side: _Side, plan: StepPlan, t: float, counts: np.ndarray) -> None:
        st, q = self.st, side.queues
        done = st.emit(plan.decode, t, counts) if len(plan.decode) else plan.decode
        side.kv.settle(plan.decode, counts)  # rejected drafts give their slots back
        q.running.remove(done)
        also_done = []
        for r, items in plan.prefill.items():
            q.partial[r] = None
            for i, n in items:
                st.prefilled[i] += n
                if st.prefilled[i] < st.prefill_target(i):
                    q.partial[r] = i
                elif side.on_prefilled(side, i, t):
                    also_done.append(i)
        side.busy = False
        self.finish(np.concatenate([done, np.array(also_done, dtype=np.int64)]), t)
        for other in side.kick_after:
            self.kick(other, t)

    def token_after_prefill(self, side: _Side, i: int, t: float) -> bool:
        """A prefill (or a preempted request's recompute) ended: its first token, or its next
        one; True when that was its last."""
        st = self.st
        if st.generated[i] == 0:
            st.first[i] = st.last[i] = t
            st.generated[i] = 1
        else:
            st.emit(np.array([i], dtype=np.int64), t)
        if st.generated[i] >= st.osl[i]:
            return True
        side.queues.running.add(i)
        return False

    def finish(self, ids: np.ndarray, t: float) -> None:
        if len(ids):
            self.decode_kv.release(ids)
            self.client.finished(ids, t)

    def counts(self) -> dict[str, int]:
        """Requests holding KV (admitted, not finished) and sent but not admitted."""
        sent, in_flight = self.client.next, self.client.in_flight
        admitted = self.counters.admitted
        return {"running": admitted - (sent - in_flight), "queued": sent - admitted}


def _colocated(server: _Server, config: ServingConfig, decode: EngineStepTime,
               prefill: EngineStepTime) -> Callable[[int, float], None]:
    """One side that prefills and decodes under ``config.scheduler`` -> the client's send."""
    st, dp = server.st, config.dp
    cls = scheduler_class(config.scheduler)
    q = SideQueues(dp, config.chunked_prefill_size)
    kv = cls.make_kv(dp, config.kv_capacity_tokens, st, st.rank, config)
    kv.lookahead = config.mtp
    side = _Side("colocated", q, kv, cls(q, st, kv, config, server.counters), decode, prefill,
                 server.token_after_prefill)
    server.decode_kv = kv
    dispatcher = Dispatcher(dp, config.dp_balance, lambda r: q.pending(r) + int(
        np.count_nonzero(st.rank[q.running.ids] == r)))

    def send(i: int, t: float) -> None:
        r = dispatcher.pick()
        st.rank[i] = r
        q.queues[r].append(i)
        server.kick(side, t)

    return send


def _disaggregated(server: _Server, config: ServingConfig, decode: EngineStepTime,
                   prefill: EngineStepTime) -> Callable[[int, float], None]:
    """A prefill side that ships each prompt's KV to a decode side -> the client's send."""
    st, dp, pdp = server.st, config.dp, config.prefill_dp
    prank = np.full(len(st.isl), -1, dtype=np.int64)
    dcls, pcls = scheduler_class("disagg_decode"), scheduler_class("disagg_prefill")
    dq, pq = SideQueues(dp, config.chunked_prefill_size), SideQueues(pdp,
                                                                      config.chunked_prefill_size)
    dkv = dcls.make_kv(dp, config.kv_capacity_tokens, st, st.rank, config)
    dkv.lookahead = config.mtp
    pkv = pcls.make_kv(pdp, config.prefill_kv_capacity_tokens, st, prank, config)
    counters = server.counters

    def transferred(t: float, i: int) -> None:
        pkv.release(np.array([i], dtype=np.int64))
        if server.token_after_prefill(dside, i, t):
            server.finish(np.array([i], dtype=np.int64), t)
        else:
            server.kick(dside, t)
        server.kick(pside, t)

    def ship(side: _Side, i: int, t: float) -> bool:
        arrive = t + config.kv_transfer_latency_s \
            + config.kv_transfer_s_per_token * float(st.isl[i])
        server.loop.at(arrive, lambda t_arr: transferred(t_arr, i))
        return False

    dside = _Side("decode", dq, dkv, dcls(dq, st, dkv, config, counters), decode, decode,
                  server.token_after_prefill)
    pside = _Side("prefill", pq, pkv, pcls(pq, st, pkv, config, counters, decode_kv=dkv),
                  prefill, prefill, ship)
    dside.kick_after = [pside, dside]  # freed decode KV may admit prefills
    server.decode_kv = dkv
    pdispatch = Dispatcher(pdp, config.dp_balance, lambda r: pq.pending(r))
    ddispatch = Dispatcher(dp, config.dp_balance, lambda r: int(dkv.used[r]))

    def send(i: int, t: float) -> None:
        prank[i] = pdispatch.pick()
        st.rank[i] = ddispatch.pick()
        pq.queues[prank[i]].append(i)
        server.kick(pside, t)

    return send


def _check_fits(st: RequestState, config: ServingConfig) -> None:
    # a request holds its prompt, every output token, and the drafts a verify step writes past
    # its last token (their KV is computed before they are accepted or rejected)
    need = st.isl + st.osl + config.mtp
    too_big = np.flatnonzero(need > config.kv_capacity_tokens)
    if len(too_big):
        i = int(too_big[0])
        raise EpsimError(
            f"request {i} needs {int(need[i])} KV tokens ({int(st.isl[i])} in + "
            f"{int(st.osl[i])} out) but a rank's KV cache holds {config.kv_capacity_tokens}; "
            "it can never be served (more GPUs, FP8 KV, or shorter requests)")
    if config.disaggregated and int(st.isl.max()) > config.prefill_kv_capacity_tokens:
        raise EpsimError(
            f"a {int(st.isl.max())}-token prompt does not fit a prefill rank's KV cache of "
            f"{config.prefill_kv_capacity_tokens} tokens")


def _as_costs(model: StepTimeModel | EngineStepTime) -> EngineStepTime:
    return model if isinstance(model, EngineStepTime) else EngineStepTime.of(model)


def _calls_made(costs: Iterable[EngineStepTime]) -> int:
    """Exact step evaluations made since each model's first use in this run (a model may be
    shared with earlier runs: a sweep's cache)."""
    first: dict[int, tuple[Any, int]] = {}
    for c in costs:
        for key, (model, before) in c.touched.items():
            if key not in first or before < first[key][1]:
                first[key] = (model, before)
    return sum(int(getattr(m, "calls", 0)) - before for m, before in first.values())


def simulate_serving(requests: Requests, config: ServingConfig,
                     decode_model: StepTimeModel | EngineStepTime,
                     prefill_model: StepTimeModel | EngineStepTime | None = None, *,
                     max_concurrency: int | None = None) -> ServingRun:
    """Run the benchmark: every request from send to last token -> :class:`ServingRun`.

    ``decode_model`` costs the decode side's steps (co-located: its prefill chunks too, unless
    ``prefill_model`` is given); ``prefill_model`` costs the prefill ranks' steps when
    disaggregated (default: ``decode_model``). Either is a :class:`StepTimeModel` (every step
    costed as it is) or an :class:`EngineStepTime` (graph, DBO and host time by an engine's
    :class:`StepPolicy`).
    """
    config.validate()
    st = RequestState(requests)
    _check_fits(st, config)
    decode = _as_costs(decode_model)
    prefill = _as_costs(prefill_model) if prefill_model is not None else decode
    for c in (decode, prefill):
        c.touched = {}
    loop = EventLoop()
    spec = DraftAcceptance(config.mtp, config.mtp_acceptance, config.seed)
    server = _Server(st, loop, Counters(), spec)
    build = _disaggregated if config.disaggregated else _colocated
    client = Client(st, requests, max_concurrency, loop, build(server, config, decode, prefill))
    server.client = client
    client.start()
    loop.run()
    if np.isnan(st.done).any():  # a scheduling bug, never a user error
        raise AssertionError(f"{int(np.isnan(st.done).sum())} requests never finished")
    return ServingRun(
        requests=requests, send_s=st.send, first_token_s=st.first, done_s=st.done,
        itls_s=np.concatenate(st.itls) if st.itls else np.zeros(0), steps=server.steps,
        config=config, sim_calls=_calls_made((decode, prefill)),
        max_running_per_rank=server.peak, preemptions=server.counters.preemptions,
        speculation=spec.metrics(),
        itl_request_ids=(np.concatenate(st.itl_ids) if st.itl_ids
                         else np.zeros(0, dtype=np.int64)),
    )


#: every registered policy (the CLI's and the docs' list)
SCHEDULER_NAMES = tuple(SCHEDULERS)
