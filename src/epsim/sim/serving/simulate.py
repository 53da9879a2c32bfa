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
    scheduler    each side's scheduler (``sim/serving/schedulers.py``, a registry of policies) answers
                 what runs in the next step: which prompt chunks, which decodes, which requests
                 are admitted into the KV cache (``sim/serving/kv_pools.py``) or preempted.
    steps        the loop costs the plan (``sim/serving/step_time.py``), and when the step ends
                 advances the chunks and emits the tokens, the same for every policy. A prompt
                 whose prefill ends gives its first token (co-located), or ships its KV cache
                 over the NIC to its decode rank (disaggregated: the decode rank's KV was
                 reserved before the prefill started, as SGLang/Mooncake pre-allocate; the first
                 token reaches the client when the KV has arrived). A preempted request's
                 recompute ends with its next token instead.
    instances    a side may be cut into independent instances (each its own ranks, queues,
                 KV cache and steps) behind a router (``sim/serving/router.py``); every instance runs in
                 the same event loop (``sim/serving/loop.py``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from epsim.model.errors import EpsimError
from epsim.sim.workload.spec import Requests

from .config import ServingConfig
from .loop import Server, StepRecord, colocated_instances, disaggregated
from .schedulers import Counters
from .speculation import DraftAcceptance
from .state import Client, EventLoop, RequestState
from .step_time import EngineStepTime, StepTimeModel
from .tally import Gaps, StepTally

# --------------------------------------------------------------------------------------------
# Configuration and results
# --------------------------------------------------------------------------------------------


@dataclass
class ServingRun:
    """Everything a benchmark run produced (arrays indexed by request id).

    requests: what was sent.
    send_s / first_token_s / done_s: per request, in seconds from the start.
    itls_s: every inter-token gap of every request, pooled (vLLM's ITL population), in emit
        order; ``None`` unless the run kept its per-request lists (``details``).
    itl_request_ids: the request of each gap of ``itls_s`` (its per-request lists, in time
        order); ``None`` likewise.
    steps: every engine step (empty unless the run kept them: ``details``).
    gaps: the gaps as the run tallied them (``sim.serving.tally.Gaps``: each value with its
        multiplicity and instance), what the metrics read; built from ``itls_s`` when not given.
    tally: the step figures accumulated as the run went (``sim.serving.tally.StepTally``), what the
        metrics read; built from ``steps`` when not given.
    sim_calls: exact step-time evaluations this run made (memo misses).
    max_running_per_rank: the most requests one rank decoded in one step.
    speculation: under MTP, vLLM's ``spec_decode_*`` counters (``epsim.sim.serving.speculation``);
        empty otherwise.
    preemptions: times a request's KV was taken back (vLLM's preemption, SGLang's
        retraction) to be recomputed later.
    instance / prefill_instance: per request, the (co-located or decode) instance and the
        prefill instance it was routed to (``None`` when co-located); itl_instance: per value of
        ``itls_s``, the instance that emitted it (``None`` without details); request_preemptions:
        per request, times its KV was taken back.
    """

    requests: Requests
    send_s: np.ndarray
    first_token_s: np.ndarray
    done_s: np.ndarray
    itls_s: np.ndarray | None
    steps: list[StepRecord]
    config: ServingConfig
    sim_calls: int = 0
    max_running_per_rank: int = 0
    preemptions: int = 0
    speculation: dict[str, Any] = field(default_factory=dict)
    itl_request_ids: np.ndarray | None = field(
        default_factory=lambda: np.zeros(0, dtype=np.int64))
    instance: np.ndarray | None = None
    prefill_instance: np.ndarray | None = None
    itl_instance: np.ndarray | None = None
    request_preemptions: np.ndarray | None = None
    gaps: Gaps | None = None
    tally: StepTally | None = None

    def __post_init__(self) -> None:
        if self.gaps is None:
            self.gaps = Gaps.from_raw(self.itls_s, self.itl_request_ids, self.itl_instance,
                                      self.first_token_s)
        if self.tally is None:
            self.tally = StepTally.of_steps(self.steps)




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


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (restored as it was after).

    The serving loop keeps its state in arrays and makes few reference cycles (about 10,000
    unreachable objects after a 4,096-request run, 18,000 after 40,960), while every full pass
    of the collector rescans every live object: the op graphs and step memos (some 100,000).
    Measured on the 2-core machine, one run each: the 1,000,000-request run 57.4 s -> 52.8 s,
    peak RSS 561 -> 567 MB (docs/performance.md). Objects freed by reference counting go as
    before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate_serving(requests: Requests, config: ServingConfig,
                     decode_model: StepTimeModel | EngineStepTime,
                     prefill_model: StepTimeModel | EngineStepTime | None = None, *,
                     concurrency: int | None = None, details: bool = True,
                     progress: Callable[[int, int], None] | None = None,
                     rank_counts: bool | None = None) -> ServingRun:
    """Run the benchmark: every request from send to last token -> :class:`ServingRun`.

    ``details``: keep every step's record and every request's gaps (a serving trace, vLLM's
    per-request lists); without, the run keeps per request only its times and lengths, and
    the metrics' figures as they accumulate (``sim.serving.tally``): the same metrics, in memory
    that grows with requests and steps, not tokens. ``progress(finished, total)`` is called
    about every 1/200 of the requests. ``rank_counts``: the kept steps carry each rank's KV use,
    running and queued requests (the serving trace's per-rank counters; O(requests) a step, so
    a search that keeps its steps only for a steady window leaves them out); default: with
    ``details``.

    ``decode_model`` costs the decode side's steps (co-located: its prefill chunks too, unless
    ``prefill_model`` is given); ``prefill_model`` costs the prefill ranks' steps when
    disaggregated (default: ``decode_model``). Either is a :class:`StepTimeModel` (every step
    costed as it is) or an :class:`EngineStepTime` (graph, DBO and host time by an engine's
    :class:`StepPolicy`).
    """
    config.validate()
    st = RequestState(requests, keep_requests=details)
    _check_fits(st, config)
    decode = _as_costs(decode_model)
    prefill = _as_costs(prefill_model) if prefill_model is not None else decode
    for c in (decode, prefill):
        c.touched = {}
    loop = EventLoop()
    spec = DraftAcceptance(config.mtp, config.mtp_acceptance, config.seed)
    server = Server(st, loop, Counters(), spec, keep_steps=details,
                    rank_counts=details if rank_counts is None else rank_counts)
    build = disaggregated if config.disaggregated else colocated_instances
    client = Client(st, requests, concurrency, loop, build(server, config, decode, prefill),
                    progress)
    server.client = client
    with cyclic_gc_paused():
        client.start()
        loop.run()
    if np.isnan(st.done).any():  # a scheduling bug, never a user error
        raise AssertionError(f"{int(np.isnan(st.done).sum())} requests never finished")
    gaps = st.gaps.finish()
    itl_ids = gaps.raw_request_ids
    return ServingRun(
        requests=requests, send_s=st.send, first_token_s=st.first, done_s=st.done,
        itls_s=gaps.raw, steps=server.steps,
        config=config, sim_calls=_calls_made((decode, prefill)),
        max_running_per_rank=server.peak, preemptions=server.counters.preemptions,
        itl_request_ids=itl_ids, speculation=spec.metrics(), instance=st.owner,
        request_preemptions=st.preemptions, prefill_instance=server.prefill_instance,
        # a request decodes on the instance routed to
        itl_instance=st.owner[itl_ids] if itl_ids is not None else None,
        gaps=gaps, tally=server.tally,
    )

