"""Steady-state measurement: the benchmark's metrics over a window that leaves out the run's
warm-up and cool-down (``--measure steady``; ``burst``: the whole run, ``vllm bench serve``'s
figures for a finite run).

Benchmark forks of vLLM and SGLang drop a ``--warmup-time`` and a ``--cooldown-time`` from every
metric. A closed loop's warm-up is its start-up burst (every slot sent at once, the first TTFTs
are the burst's queue) and its cool-down the drain after the client sends its last request (the
in-flight count falls, the last requests run in emptier steps). epsim cuts the window by
events rather than by seconds, so the same rule holds at any scale:

    warm-up    ends at ``start``: the last completion among the first ``K`` requests sent, ``K`` the
               concurrency cap (the burst), or without a cap ``ceil(WARMUP_SHARE * N)``
    cool-down  begins at ``end``: the last request's send (the client stops refilling)
    latency    TTFT, TPOT, ITL and E2EL of the requests done in ``(start, end]``, the burst's
               left out (in a closed loop each of them was sent when a slot freed, to an engine
               holding the concurrency in flight: the steady load)
    throughput those completions (their requests, input and output tokens) over
               ``end - start``; goodput: those that meet every ``--goodput`` SLO, over it
The step figures (``decode_throughput``, ``mean_decode_step_ms``, KV use, ...) and a run's
per-instance entries stay whole-run figures. ``steady_num_prompts`` sizes a run whose
``num_prompts`` is not given so the window holds ``STEADY_COMPLETIONS_PER_RANK`` completions per
decode rank that can be busy (all of them, or as many as the concurrency cap when it is lower:
at concurrency 1 one request runs at a time on one rank, and its repeats on idle ranks would
only lengthen the run), doubling it while the window holds fewer, ``MAX_DOUBLINGS`` times at
most.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from epsim.model.errors import EpsimError
from epsim.sim.workload.spec import Requests, WorkloadSpec

from .metrics import NoSteadyWindow, compute_metrics, good_requests
from .simulate import ServingRun
from .tally import Gaps

#: completions per decode rank the steady window is sized to hold (an assumption of how many a
#: stable mean needs, not a measurement: a named parameter)
STEADY_COMPLETIONS_PER_RANK = 16
#: times a run sized for its window doubles its requests while the window holds fewer
#: completions than that (an engine that admits in blocks, e.g. SGLang's prefill-first
#: scheduler against a KV cache that holds less than the concurrency, clears the burst in several
#: waves)
MAX_DOUBLINGS = 4
#: open loop without a concurrency cap: the share of the requests, first sent, whose
#: completion ends the warm-up
WARMUP_SHARE = 0.1
#: the rule, as the JSON's ``window.rule`` states it
RULE = ("warm-up ends at the last completion of the first K requests sent (K: the concurrency, "
        f"else {WARMUP_SHARE:g} of the requests); cool-down begins at the last send; every "
        "metric over the requests done in between (the first K left out), throughput over "
        "its duration")


def warmup_requests(n: int, concurrency: int | None) -> int:
    """``K``: the requests whose completions make the warm-up."""
    return min(n, concurrency) if concurrency else max(1, math.ceil(WARMUP_SHARE * n))


def target_completions(concurrency: int | None, ranks: int) -> int:
    """The completions a steady window is sized to hold: ``STEADY_COMPLETIONS_PER_RANK`` per
    rank that can be busy (``min(ranks, concurrency)``). Example: ``(1, 8)`` -> 16."""
    busy = min(max(1, ranks), concurrency) if concurrency else max(1, ranks)
    return STEADY_COMPLETIONS_PER_RANK * busy


def steady_num_prompts(concurrency: int | None, ranks: int) -> int:
    """Requests enough for the window to hold ``target_completions``: a closed loop loses about
    one concurrency's worth to each of warm-up and cool-down."""
    want = target_completions(concurrency, ranks)
    if concurrency:
        return 2 * concurrency + want
    return math.ceil(want / (1 - 2 * WARMUP_SHARE))


@dataclass(frozen=True)
class SteadyWindow:
    """start_s / end_s: the window; warmup_requests: ``K``; measured: the requests done in
    ``(start, end]``, the first ``K`` sent left out (a boolean mask over the run's requests)."""

    start_s: float
    end_s: float
    warmup_requests: int
    measured: np.ndarray

    def echo(self, ranks: int) -> dict[str, Any]:
        n = int(self.measured.sum())
        return {"start_s": self.start_s, "end_s": self.end_s,
                "duration_s": self.end_s - self.start_s, "warmup_requests": self.warmup_requests,
                "completions": n, "ranks": ranks, "completions_per_rank": n / max(1, ranks),
                "target_completions_per_rank": STEADY_COMPLETIONS_PER_RANK, "rule": RULE}


def steady_window(send_s: np.ndarray, done_s: np.ndarray, concurrency: int | None
                  ) -> SteadyWindow:
    """The window of a run's per-request send and done times (module docstring); a window with
    no measured request is an error naming the fix."""
    n = len(send_s)
    k = warmup_requests(n, concurrency)
    first_sent = np.argsort(send_s, kind="stable")[:k]
    start, end = float(done_s[first_sent].max()), float(send_s.max())
    measured = (done_s > start) & (done_s <= end)
    measured[first_sent] = False
    if end <= start or not measured.any():
        raise NoSteadyWindow(
            f"--measure steady: {n} requests leave no steady window after the warm-up of {k} "
            "(every request sent before the warm-up completed: the load outruns the engine, "
            "or too few --num-prompts); lower the load, omit --num-prompts, or --measure burst")
    return SteadyWindow(start, end, k, measured)


def _measured_run(run: ServingRun, keep: np.ndarray) -> ServingRun:
    """The run's measured requests only, with their own gaps (a run kept with ``details``)."""
    if run.itls_s is None or run.itl_request_ids is None:
        raise ValueError("a steady window needs the run's per-request gaps (details=True)")
    req = run.requests
    sub = Requests(input_lens=req.input_lens[keep], output_lens=req.output_lens[keep],
                   issue_times_s=req.issue_times_s[keep])
    gaps = run.itls_s[keep[run.itl_request_ids]]
    return replace(run, requests=sub, send_s=run.send_s[keep],
                   first_token_s=run.first_token_s[keep], done_s=run.done_s[keep],
                   itls_s=gaps, itl_request_ids=None, itl_instance=None,
                   gaps=Gaps.from_raw(gaps))


def steady_metrics(run: ServingRun, concurrency: int | None, ranks: int,
                   percentiles: Sequence[float], percentile_metrics: Sequence[str],
                   goodput: Sequence[tuple[str, float]] = ()) -> dict[str, Any]:
    """``compute_metrics`` over the steady window, with the window under ``"window"``."""
    w = steady_window(run.send_s, run.done_s, concurrency)
    sub = _measured_run(run, w.measured)
    m = compute_metrics(sub, percentiles, percentile_metrics)
    duration = w.end_s - w.start_s
    done = w.measured
    ins, outs = int(run.requests.input_lens[done].sum()), int(run.requests.output_lens[done].sum())
    rate = int(done.sum()) / duration
    m.update(completed=int(np.count_nonzero(~np.isnan(run.done_s))), num_prompts=len(run.requests),
             duration=duration, total_input_tokens=ins, total_output_tokens=outs,
             request_throughput=rate, output_throughput=outs / duration,
             total_token_throughput=(ins + outs) / duration)
    if goodput:
        m["request_goodput"] = good_requests(sub, goodput) / duration
    return {"measure": "steady", **m, "window": w.echo(ranks)}


def measured_run(w: WorkloadSpec, ranks: int, requests: Requests | None,
                 sample: Callable[[WorkloadSpec], Requests],
                 simulate: Callable[[Requests, bool], ServingRun],
                 measured: tuple[Sequence[float], Sequence[str], Sequence[tuple[str, float]]]
                 ) -> tuple[ServingRun, dict[str, Any]]:
    """Sample (unless ``requests`` are given) and ``simulate(requests, details)`` the benchmark,
    then its metrics as ``w.measure`` asks (``measured``: percentiles, percentile metrics,
    goodput SLOs). A steady run whose ``num_prompts`` is not given is sized by
    ``steady_num_prompts`` and doubled while its window is short (module docstring)."""
    if w.measure != "steady":
        run = simulate(requests if requests is not None else sample(w), False)
        return run, compute_metrics(run, *measured)
    sized = requests is None and w.num_prompts is None
    n = steady_num_prompts(w.concurrency, ranks)
    want = target_completions(w.concurrency, ranks)
    doubling = 0
    while True:
        if requests is None:
            run = simulate(sample(replace(w, num_prompts=n) if sized else w), True)
        else:
            run = simulate(requests, True)
        last = not sized or doubling == MAX_DOUBLINGS
        try:
            m = steady_metrics(run, w.concurrency, ranks, *measured)
            if last or m["window"]["completions"] >= want:
                return run, m
        except EpsimError:  # no window yet: more requests, unless this was the last try
            if last:
                raise
        n, doubling = 2 * n, doubling + 1
