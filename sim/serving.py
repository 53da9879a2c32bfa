"""The serving simulation: a benchmark client against continuous-batching DP ranks.

What is simulated (event by event, one event per step of each engine, not per token):

    client       sends each request at ``max(issue time, a free concurrency slot)``; a request's
                 clock (TTFT, E2E latency) starts when it is sent, as in ``vllm bench serve``.
    dispatch     a sent request goes to one dp rank, round robin (SGLang's DP-attention default)
                 or to the least loaded one; it waits in that rank's FIFO queue.
    admission    a request is admitted when the rank's KV cache can hold its whole sequence
                 (prompt + every output token; output lengths are exact): requests wait while the
                 cache is full and are never dropped; one that could never fit is an error.
    co-located   every rank holding queued or part-prefilled prompts runs a prefill step of at
                 most ``chunked_prefill_size`` tokens (prefill first, as SGLang's scheduler does);
                 the other ranks run a decode step for their running requests in the same step.
                 With DP attention and EP every rank steps together (the MoE all-to-all
                 synchronises them), so a step lasts as long as its busiest rank needs.
    disaggregated prefill ranks (their own nodes) prefill, then ship the prompt's KV cache to a
                 decode rank over the NIC; the decode rank's KV is reserved before the prefill
                 starts (as SGLang/Mooncake pre-allocate) and the prefill rank's is released when
                 the transfer ends. The first token reaches the client when the KV has arrived.

Step times come from a :class:`StepTimeModel`: :class:`SimulatedStepTime` asks the step simulator
(``epsim.sim.step.simulate_step``) for each point of a geometric (batch, context) grid once and
interpolates between grid points, so a several-thousand-request benchmark costs a few dozen step
simulations.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from epsim.model.errors import EpsimError
from epsim.model.mtp import DEFAULT_ACCEPTANCE, check_acceptance

from .speculation import DraftAcceptance
from .workload import Requests

DP_BALANCE = ("round_robin", "least_loaded")


# --------------------------------------------------------------------------------------------
# Step times
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """What one step of every rank costs.

    seconds: the step's wall time (the busiest rank's). Example: 0.19.
    breakdown_ms: milliseconds by category (attention, moe_experts, dispatch, ...), as the step
        simulator reports them. Example: ``{"attention": 60.1, "dispatch": 20.3, ...}``.
    expert_imbalance: max GPU expert load / mean (1.0 = perfectly balanced). Example: 1.04.
    exposed_comm_ms: communication time not hidden behind compute.
    """

    seconds: float
    breakdown_ms: Mapping[str, float] = field(default_factory=dict)
    expert_imbalance: float = 1.0
    exposed_comm_ms: float = 0.0


class StepTimeModel(Protocol):
    """Step times of one engine (one dp rank's batch; every rank steps together)."""

    def decode(self, seqs: int, context: int) -> StepCost:
        """A decode step: ``seqs`` sequences per rank, each attending to ``context`` tokens."""
        ...

    def prefill(self, seqs: int, prompt: int, prefix: int) -> StepCost:
        """A prefill step: ``seqs`` sequences per rank of ``prompt - prefix`` new tokens each,
        after ``prefix`` tokens already cached (chunked prefill)."""
        ...


def mix_costs(a: StepCost, b: StepCost, w: float) -> StepCost:
    """``(1 - w) * a + w * b``, field by field (breakdown keys united)."""
    if w <= 0.0:
        return a
    if w >= 1.0:
        return b
    keys = list(dict.fromkeys([*a.breakdown_ms, *b.breakdown_ms]))
    return StepCost(
        seconds=(1 - w) * a.seconds + w * b.seconds,
        breakdown_ms={k: (1 - w) * a.breakdown_ms.get(k, 0.0) + w * b.breakdown_ms.get(k, 0.0)
                      for k in keys},
        expert_imbalance=(1 - w) * a.expert_imbalance + w * b.expert_imbalance,
        exposed_comm_ms=(1 - w) * a.exposed_comm_ms + w * b.exposed_comm_ms,
    )


#: values up to this are their own grid points; above it the grid is geometric
GRID_EXACT = 16


def grid_bracket(x: int, per_octave: int = 8) -> tuple[int, int]:
    """The grid points just below and above ``x`` (equal when ``x`` is one) -> (lo, hi).

    The grid: every integer up to ``GRID_EXACT``, then ``round(GRID_EXACT * 2**(k/per_octave))``.
    """
    if x <= GRID_EXACT:
        return x, x
    k = per_octave * math.log2(x / GRID_EXACT)
    lo = round(GRID_EXACT * 2 ** (math.floor(k + 1e-9) / per_octave))
    hi = round(GRID_EXACT * 2 ** (math.ceil(k - 1e-9) / per_octave))
    lo, hi = min(lo, x), max(hi, x)
    return lo, hi


def grid_nearest(x: int, per_octave: int = 8) -> int:
    """The grid point nearest to ``x`` in log space (``x`` itself up to ``GRID_EXACT``)."""
    lo, hi = grid_bracket(x, per_octave)
    if lo == hi:
        return lo
    return lo if math.log(x / lo) <= math.log(hi / x) else hi


class MemoStepTime:
    """Memoise and interpolate any exact step-time function on the (batch, context) grid.

    ``decode(seqs, context)`` is bilinear between the four surrounding grid points (the step
    time is smooth in both); ``prefill`` rounds seqs and new tokens to the nearest grid point and
    the prefix to a coarser one. ``calls`` counts the exact evaluations made.
    """

    def __init__(self, decode_exact: Callable[[int, int], StepCost],
                 prefill_exact: Callable[[int, int, int], StepCost], per_octave: int = 8) -> None:
        self._decode_exact = decode_exact
        self._prefill_exact = prefill_exact
        self.per_octave = per_octave
        self._memo: dict[tuple[Any, ...], StepCost] = {}
        self.calls = 0

    def _get(self, key: tuple[Any, ...], fn: Callable[[], StepCost]) -> StepCost:
        cost = self._memo.get(key)
        if cost is None:
            cost = fn()
            self.calls += 1
            self._memo[key] = cost
        return cost

    def decode(self, seqs: int, context: int) -> StepCost:
        s0, s1 = grid_bracket(seqs, self.per_octave)
        c0, c1 = grid_bracket(context, self.per_octave)

        def at(s: int, c: int) -> StepCost:
            return self._get(("d", s, c), lambda: self._decode_exact(s, c))

        ws = 0.0 if s1 == s0 else (seqs - s0) / (s1 - s0)
        wc = 0.0 if c1 == c0 else (context - c0) / (c1 - c0)
        low = mix_costs(at(s0, c0), at(s0, c1), wc) if wc else at(s0, c0)
        if not ws:
            return low
        high = mix_costs(at(s1, c0), at(s1, c1), wc) if wc else at(s1, c0)
        return mix_costs(low, high, ws)

    def prefill(self, seqs: int, prompt: int, prefix: int) -> StepCost:
        s = grid_nearest(seqs, self.per_octave)
        new = grid_nearest(prompt - prefix, self.per_octave)
        # a chunk's mean prefix matters through attention only, next to the new tokens' own
        # attention: under 1/16 of them it is dropped, above it a coarse grid (2 per octave)
        pre = grid_nearest(prefix, 2) if prefix * 16 >= new else 0
        return self._get(("p", s, new, pre), lambda: self._prefill_exact(s, pre + new, pre))


def _cost_from_step_result(result: Any) -> StepCost:
    """A :class:`StepCost` from the step simulator's ``StepResult`` (ms or s fields alike)."""
    if hasattr(result, "step_s"):
        seconds = float(result.step_s)
    else:
        seconds = float(result.step_ms) / 1e3
    return StepCost(
        seconds=seconds,
        breakdown_ms={str(k): float(v) for k, v in dict(getattr(result, "breakdown_ms", {})).items()},
        expert_imbalance=float(getattr(result, "expert_imbalance", 1.0) or 1.0),
        exposed_comm_ms=float(getattr(result, "exposed_comm_ms", 0.0) or 0.0),
    )


class SimulatedStepTime(MemoStepTime):
    """Step times from the step simulator, memoised on the (batch, context) grid.

    model / plan / profile: what ``epsim.sim.step.simulate_step`` simulates.
    loads / placement / eplb / mode / seed: passed through (expert loads, placement, whether
        EPLB re-places experts, the simulator's mode, the routing seed).
    """

    def __init__(self, model: Any, plan: Any, profile: Any, *, loads: Any = None,
                 placement: Any = None, eplb: bool = True, mode: str = "fast", seed: int = 0,
                 per_octave: int = 8) -> None:
        from epsim.model.opgraph import Batch

        from .step import simulate_step  # the step simulator (sim/step.py)

        def run(batch: Batch) -> StepCost:
            return _cost_from_step_result(simulate_step(
                model, plan, batch, profile, loads=loads, placement=placement, eplb=eplb,
                mode=mode, seed=seed))

        super().__init__(lambda s, c: run(Batch.decode(s, c)),
                         lambda s, p, pre: run(Batch.prefill(s, p, pre)), per_octave)


# --------------------------------------------------------------------------------------------
# Configuration and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingConfig:
    """The serving deployment's scheduling parameters.

    dp: decode-side dp ranks (co-located: all ranks). Example: 8.
    kv_capacity_tokens: KV-cache tokens one decode rank holds (``memory_budget``). Example:
        1_925_783 (DeepSeek-R1, DP8/EP8, MI300X, FP8 KV).
    chunked_prefill_size: prompt tokens one rank prefills per step at most. Example: 8192.
    dp_balance: ``"round_robin"`` or ``"least_loaded"`` (fewest requests queued or running).
    prefill_dp: disaggregated: prefill ranks (``None``: prefill co-located with decode).
    prefill_kv_capacity_tokens: disaggregated: KV tokens one prefill rank holds.
    kv_transfer_s_per_token: disaggregated: seconds to ship one prompt token's KV over the NIC.
    kv_transfer_latency_s: disaggregated: fixed cost per transfer (handshake).
    mtp / mtp_acceptance: MTP speculative decoding: draft tokens verified per decode step and
        each one's acceptance probability (``epsim.sim.speculation``); 0: off.
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
    mtp: int = 0
    mtp_acceptance: float = DEFAULT_ACCEPTANCE
    seed: int = 0

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
        if self.disaggregated:
            if self.prefill_dp < 1 or not self.prefill_kv_capacity_tokens \
                    or self.prefill_kv_capacity_tokens < 1:
                raise EpsimError("disaggregated serving needs prefill ranks with a KV cache")
        if self.mtp < 0:
            raise EpsimError(f"mtp must be 0 or more draft tokens, got {self.mtp}")
        check_acceptance(self.mtp_acceptance)
        return self


@dataclass
class StepRecord:
    """One step of one engine.

    engine: ``"colocated"``, ``"prefill"`` or ``"decode"``.
    start_s / seconds: when it started and how long it took.
    kind: ``"decode"`` (every active rank decodes), ``"prefill"`` (every active rank prefills)
        or ``"mixed"`` (some ranks prefill while the others decode).
    decode_tokens / prefill_tokens: tokens produced (under MTP, every accepted draft and the
        token after them) / prompt tokens processed, all ranks.
    max_seqs / context: the decode batch the step was costed for (busiest rank).
    cost: the decode part's :class:`StepCost` (``None`` without decode).
    kv_usage: reserved KV share of the step's ranks at its start, after admission, in [0, 1]
        (the decode ranks', or the prefill ranks' for a disaggregated prefill step).
    rank_prefill_tokens / rank_decode_seqs: ``[ranks]`` of the engine, the prompt tokens each
        rank prefilled / the sequences it decoded in this step (a rank does one or the other).
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
    itls_s: every inter-token gap of every request, pooled (vLLM's ITL population): one per
        output a request receives after its first, an output holding every token a step
        emitted for it (several under MTP).
    steps: every engine step.
    sim_calls: exact step-time evaluations this run made (memo misses).
    speculation: under MTP, vLLM's ``spec_decode_*`` counters (``epsim.sim.speculation``);
        empty otherwise.
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
    speculation: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# The engines
# --------------------------------------------------------------------------------------------


class _Loop:
    """A min-heap of timed callbacks (ties in insertion order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._n = 0

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (t, self._n, fn))
        self._n += 1

    def run(self) -> None:
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            fn(t)


class _State:
    """Per-request arrays shared by the client and the engines."""

    def __init__(self, req: Requests) -> None:
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
        self.itls: list[np.ndarray] = []


class _KV:
    """Reserved KV tokens per rank."""

    def __init__(self, ranks: int, capacity: int) -> None:
        self.capacity = capacity
        self.used = np.zeros(ranks, dtype=np.int64)

    def fits(self, rank: int, tokens: int) -> bool:
        return self.used[rank] + tokens <= self.capacity

    def usage(self) -> float:
        return float(self.used.sum()) / (self.capacity * len(self.used))


class _Ranks:
    """Prefill side of a set of dp ranks: FIFO queues, one part-prefilled request per rank."""

    def __init__(self, ranks: int, chunk: int) -> None:
        self.queues: list[deque[int]] = [deque() for _ in range(ranks)]
        self.partial: list[int | None] = [None] * ranks
        self.chunk = chunk

    def has_work(self, r: int) -> bool:
        return bool(self.queues[r]) or self.partial[r] is not None

    def pending(self, r: int) -> int:
        return len(self.queues[r]) + (self.partial[r] is not None)


class _Dispatcher:
    """Picks a dp rank for each request."""

    def __init__(self, ranks: int, method: str, load: Callable[[int], int]) -> None:
        self.ranks, self.method, self.load = ranks, method, load
        self._next = 0

    def pick(self) -> int:
        if self.method == "round_robin":
            r = self._next
            self._next = (self._next + 1) % self.ranks
            return r
        return min(range(self.ranks), key=lambda r: (self.load(r), r))


def _form_chunk(st: _State, ranks: _Ranks, r: int, admit: Callable[[int, int], bool]
                ) -> list[tuple[int, int]]:
    """Rank ``r``'s next prefill chunk: ``[(request, tokens)]`` within the chunk budget.

    The part-prefilled request continues first; then queued requests in FIFO order while
    ``admit(rank, request)`` reserves their KV (head-of-line: the first that does not fit stops
    the admission, so no request overtakes another).
    """
    items: list[tuple[int, int]] = []
    budget = ranks.chunk
    p = ranks.partial[r]
    if p is not None:
        take = int(min(st.isl[p] - st.prefilled[p], budget))
        items.append((p, take))
        budget -= take
    q = ranks.queues[r]
    while budget > 0 and q:
        head = q[0]
        if not admit(r, head):
            break
        q.popleft()
        take = int(min(st.isl[head], budget))
        items.append((head, take))
        budget -= take
    return items


def _prefill_cost(model: StepTimeModel, st: _State, items: list[tuple[int, int]]) -> StepCost:
    """Cost a rank's chunk as ``seqs`` uniform sequences of the mean new tokens and prefix."""
    seqs = len(items)
    new = sum(t for _, t in items)
    prefix = sum(int(st.prefilled[i]) for i, _ in items)
    new_per = max(1, round(new / seqs))
    pre_per = round(prefix / seqs)
    return model.prefill(seqs, pre_per + new_per, pre_per)


class _Running:
    """Requests in decode, as one array of ids (all ranks)."""

    def __init__(self, ranks: int) -> None:
        self.ids = np.zeros(0, dtype=np.int64)
        self.ranks = ranks
        self._incoming: list[int] = []

    def add(self, i: int) -> None:
        self._incoming.append(i)

    def flush(self) -> None:
        if self._incoming:
            self.ids = np.concatenate([self.ids, np.array(self._incoming, dtype=np.int64)])
            self._incoming = []

    def count(self, st: _State) -> np.ndarray:
        return np.bincount(st.rank[self.ids], minlength=self.ranks)


def _decode_batch(st: _State, ids: np.ndarray, ranks: int) -> tuple[int, int, np.ndarray]:
    """The decode batch a step is costed for: (max seqs on a rank, effective context, and the
    ``[ranks]`` sequences each rank decodes).

    The context is the busiest rank's summed context spread over the max seqs, so both the
    per-sequence work (GEMMs, which scale with seqs) and the attention work (which scales with
    summed context) are those of the busiest rank.
    """
    r = st.rank[ids]
    seqs = np.bincount(r, minlength=ranks)
    ctx = np.bincount(r, weights=(st.isl[ids] + st.generated[ids]).astype(np.float64),
                      minlength=ranks)
    max_seqs = int(seqs.max())
    return max_seqs, max(1, math.ceil(float(ctx.max()) / max_seqs)), seqs


def _chunk_tokens(chunks: Mapping[int, list[tuple[int, int]]], ranks: int) -> np.ndarray:
    """``[ranks]`` prompt tokens each rank prefills in a step (its chunk's summed pieces)."""
    out = np.zeros(ranks, dtype=np.int64)
    for r, chunk in chunks.items():
        out[r] = sum(n for _, n in chunk)
    return out


class _Occupancy:
    """Requests admitted (KV reserved) so far; with the client's counts, the steps' running
    (admitted, not finished) and queued (sent, not admitted) requests."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.admitted = 0

    def counts(self) -> dict[str, int]:
        sent, in_flight = self.client.next, self.client.in_flight
        return {"running": self.admitted - (sent - in_flight), "queued": sent - self.admitted}


def _emit_tokens(st: _State, ids: np.ndarray, t: float, counts: np.ndarray) -> np.ndarray:
    """``counts`` more tokens for each request in ``ids`` at time ``t``, as one output each (one
    inter-token gap, as vLLM's client times a streamed chunk); returns the finished ones."""
    st.itls.append(t - st.last[ids])
    st.last[ids] = t
    st.generated[ids] += counts
    return ids[st.generated[ids] >= st.osl[ids]]


class _Client:
    """The benchmark client: issues requests, holds at most ``cap`` in flight."""

    def __init__(self, st: _State, req: Requests, cap: int | None, loop: _Loop,
                 send: Callable[[int, float], None]) -> None:
        self.st, self.req, self.cap, self.loop, self.send_fn = st, req, cap, loop, send
        self.next = 0
        self.in_flight = 0

    def start(self) -> None:
        # one wake-up per distinct issue time; pump() sends whatever is due and has a slot
        for t in np.unique(self.req.issue_times_s):
            self.loop.at(float(t), self.pump)

    def pump(self, t: float) -> None:
        n = len(self.req)
        while self.next < n and self.req.issue_times_s[self.next] <= t + 1e-12 and (
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
            self.pump(t)


def _exact_calls(models: Iterable[StepTimeModel]) -> int:
    """Exact step evaluations the models made so far (memo misses of a :class:`MemoStepTime`)."""
    return sum(int(getattr(m, "calls", 0)) for m in models)


def simulate_serving(requests: Requests, config: ServingConfig, decode_model: StepTimeModel,
                     prefill_model: StepTimeModel | None = None, *,
                     max_concurrency: int | None = None) -> ServingRun:
    """Run the benchmark: every request from send to last token -> :class:`ServingRun`.

    ``decode_model`` costs the decode engine's steps (co-located: prefill steps too, unless
    ``prefill_model`` is given); ``prefill_model`` costs the prefill ranks' steps when
    disaggregated (default: ``decode_model``).
    """
    config.validate()
    st = _State(requests)
    # a request holds its prompt, every output token, and the drafts a verify step writes
    # past its last token (their KV is computed before they are accepted or rejected)
    need = st.isl + st.osl + config.mtp
    spec = DraftAcceptance(config.mtp, config.mtp_acceptance, config.seed)
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
    prefill_model = prefill_model or decode_model
    # a step-time model may be shared with earlier runs (a sweep's cache): count this run's calls
    models = {id(decode_model): decode_model, id(prefill_model): prefill_model}.values()
    calls_before = _exact_calls(models)
    loop = _Loop()
    steps: list[StepRecord] = []
    dp = config.dp
    dkv = _KV(dp, config.kv_capacity_tokens)
    running = _Running(dp)
    peak = [0]

    def finish(ids: np.ndarray, t: float) -> None:
        if len(ids):
            np.subtract.at(dkv.used, st.rank[ids], need[ids])
            client.finished(ids, t)

    if not config.disaggregated:
        ranks = _Ranks(dp, config.chunked_prefill_size)
        dispatcher = _Dispatcher(dp, config.dp_balance, lambda r: ranks.pending(r) + int(
            np.count_nonzero(st.rank[running.ids] == r)))
        busy, queued = [False], [False]

        def admit(r: int, i: int) -> bool:
            if not dkv.fits(r, int(need[i])):
                return False
            dkv.used[r] += need[i]
            occ.admitted += 1
            return True

        def send(i: int, t: float) -> None:
            r = dispatcher.pick()
            st.rank[i] = r
            ranks.queues[r].append(i)
            kick(t)

        def kick(t: float) -> None:
            # start on a later callback at the same time, once every event at ``t`` has landed
            if not busy[0] and not queued[0]:
                queued[0] = True
                loop.at(t, start_step)

        def start_step(t: float) -> None:
            queued[0] = False
            if busy[0]:
                return
            running.flush()
            chunks = {r: c for r in range(dp) if ranks.has_work(r)
                      for c in [_form_chunk(st, ranks, r, admit)] if c}
            ids = running.ids
            if chunks and len(ids):
                ids = ids[~np.isin(st.rank[ids], list(chunks))]
            if not chunks and not len(ids):
                busy[0] = False
                return
            busy[0] = True
            pre = max((_prefill_cost(prefill_model, st, c) for c in chunks.values()),
                      key=lambda c: c.seconds, default=None)
            dec, max_seqs, ctx, seqs = None, 0, 0, np.zeros(dp, dtype=np.int64)
            counts = np.zeros(0, dtype=np.int64)
            if len(ids):
                max_seqs, ctx, seqs = _decode_batch(st, ids, dp)
                peak[0] = max(peak[0], max_seqs)
                dec = decode_model.decode(max_seqs, ctx)
                counts = spec.tokens(st.osl[ids] - st.generated[ids])
            dt = max(pre.seconds if pre else 0.0, dec.seconds if dec else 0.0)
            kind = "mixed" if (pre and dec) else ("prefill" if pre else "decode")
            prompt = _chunk_tokens(chunks, dp)
            steps.append(StepRecord("colocated", t, dt, kind, int(counts.sum()),
                                    int(prompt.sum()), max_seqs, ctx, dec, dkv.usage(), prompt,
                                    seqs, **occ.counts()))
            loop.at(t + dt, lambda t_end: end_step(t_end, chunks, ids, counts))

        def end_step(t: float, chunks: dict[int, list[tuple[int, int]]], ids: np.ndarray,
                     counts: np.ndarray) -> None:
            done = _emit_tokens(st, ids, t, counts) if len(ids) else ids
            if len(done):
                running.ids = running.ids[~np.isin(running.ids, done)]
            first_done = []
            for r, items in chunks.items():
                ranks.partial[r] = None
                for i, n in items:
                    st.prefilled[i] += n
                    if st.prefilled[i] < st.isl[i]:
                        ranks.partial[r] = i
                        continue
                    st.first[i] = st.last[i] = t
                    st.generated[i] = 1
                    if st.osl[i] <= 1:
                        first_done.append(i)
                    else:
                        running.add(i)
            busy[0] = False
            finish(np.concatenate([done, np.array(first_done, dtype=np.int64)]), t)
            kick(t)

        client = _Client(st, requests, max_concurrency, loop, send)
        occ = _Occupancy(client)
    else:
        pdp = config.prefill_dp
        pranks = _Ranks(pdp, config.chunked_prefill_size)
        pkv = _KV(pdp, config.prefill_kv_capacity_tokens)
        prank = np.full(len(requests), -1, dtype=np.int64)
        pdispatch = _Dispatcher(pdp, config.dp_balance, lambda r: pranks.pending(r))
        ddispatch = _Dispatcher(dp, config.dp_balance, lambda r: int(dkv.used[r]))
        pbusy, dbusy, pqueued, dqueued = [False], [False], [False], [False]

        def admit_p(r: int, i: int) -> bool:
            # the decode rank's KV is pre-allocated before the prefill starts
            d = int(st.rank[i])
            if not (pkv.fits(r, int(st.isl[i])) and dkv.fits(d, int(need[i]))):
                return False
            pkv.used[r] += st.isl[i]
            dkv.used[d] += need[i]
            occ.admitted += 1
            return True

        def send(i: int, t: float) -> None:
            prank[i] = pdispatch.pick()
            st.rank[i] = ddispatch.pick()
            pranks.queues[prank[i]].append(i)
            kick_p(t)

        def kick_p(t: float) -> None:
            if not pbusy[0] and not pqueued[0]:
                pqueued[0] = True
                loop.at(t, start_prefill)

        def kick_d(t: float) -> None:
            if not dbusy[0] and not dqueued[0]:
                dqueued[0] = True
                loop.at(t, start_decode)

        def start_prefill(t: float) -> None:
            pqueued[0] = False
            if pbusy[0]:
                return
            chunks = {r: c for r in range(pdp) if pranks.has_work(r)
                      for c in [_form_chunk(st, pranks, r, admit_p)] if c}
            if not chunks:
                pbusy[0] = False
                return
            pbusy[0] = True
            pre = max((_prefill_cost(prefill_model, st, c) for c in chunks.values()),
                      key=lambda c: c.seconds)
            prompt = _chunk_tokens(chunks, pdp)
            steps.append(StepRecord("prefill", t, pre.seconds, "prefill", 0, int(prompt.sum()),
                                    0, 0, None, pkv.usage(), prompt,
                                    np.zeros(pdp, dtype=np.int64), **occ.counts()))
            loop.at(t + pre.seconds, lambda t_end: end_prefill(t_end, chunks))

        def end_prefill(t: float, chunks: dict[int, list[tuple[int, int]]]) -> None:
            for r, items in chunks.items():
                pranks.partial[r] = None
                for i, n in items:
                    st.prefilled[i] += n
                    if st.prefilled[i] < st.isl[i]:
                        pranks.partial[r] = i
                        continue
                    arrive = t + config.kv_transfer_latency_s \
                        + config.kv_transfer_s_per_token * float(st.isl[i])
                    loop.at(arrive, lambda t_arr, i=i: transferred(t_arr, i))
            pbusy[0] = False
            kick_p(t)

        def transferred(t: float, i: int) -> None:
            pkv.used[prank[i]] -= st.isl[i]
            st.first[i] = st.last[i] = t
            st.generated[i] = 1
            if st.osl[i] <= 1:
                finish(np.array([i], dtype=np.int64), t)
            else:
                running.add(i)
                kick_d(t)
            kick_p(t)

        def start_decode(t: float) -> None:
            dqueued[0] = False
            if dbusy[0]:
                return
            running.flush()
            ids = running.ids
            if not len(ids):
                dbusy[0] = False
                return
            dbusy[0] = True
            max_seqs, ctx, seqs = _decode_batch(st, ids, dp)
            peak[0] = max(peak[0], max_seqs)
            dec = decode_model.decode(max_seqs, ctx)
            counts = spec.tokens(st.osl[ids] - st.generated[ids])
            steps.append(StepRecord("decode", t, dec.seconds, "decode", int(counts.sum()), 0,
                                    max_seqs, ctx, dec, dkv.usage(),
                                    np.zeros(dp, dtype=np.int64), seqs, **occ.counts()))
            loop.at(t + dec.seconds, lambda t_end: end_decode(t_end, ids, counts))

        def end_decode(t: float, ids: np.ndarray, counts: np.ndarray) -> None:
            done = _emit_tokens(st, ids, t, counts)
            if len(done):
                running.ids = running.ids[~np.isin(running.ids, done)]
            dbusy[0] = False
            finish(done, t)
            kick_p(t)  # freed decode KV may admit prefills
            kick_d(t)

        client = _Client(st, requests, max_concurrency, loop, send)
        occ = _Occupancy(client)

    client.start()
    loop.run()
    if np.isnan(st.done).any():  # a scheduling bug, never a user error
        raise AssertionError(f"{int(np.isnan(st.done).sum())} requests never finished")
    calls = _exact_calls(models) - calls_before
    return ServingRun(
        requests=requests, send_s=st.send, first_token_s=st.first, done_s=st.done,
        itls_s=np.concatenate(st.itls) if st.itls else np.zeros(0), steps=steps, config=config,
        sim_calls=calls, max_running_per_rank=peak[0], speculation=spec.metrics(),
    )
