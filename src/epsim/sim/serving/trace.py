"""The serving run as a Chrome trace (Perfetto, chrome://tracing): what ``predict --trace`` writes.

    ranks      one track per dp rank (process "ranks"; "prefill ranks" and "decode ranks" when
               prefill is disaggregated): a slice per step the rank worked in, named "prefill"
               (args: its chunk's prompt tokens) or "decode" (args: its sequences). A rank's slice
               lasts the whole step: ranks step together behind the MoE all-to-all.
    counters   on the "requests" process, sampled at every step's start (after admission) and
               once at the end: "requests" with series "running" (admitted, holding KV, not
               finished) and "queued" (sent, waiting for admission), and "KV cache" with series
               "use" (the decode ranks' reserved share, 0..1; "prefill use" for the prefill
               ranks when disaggregated). Per rank, on its side's ranks process, at each of
               that side's steps and once at the end: "rank R requests" with series "running"
               (requests holding KV on the rank) and "queued" (waiting in its queue), and "rank R
               KV cache" with series "use" (its held share, 0..1).
    requests   one slice per request from its send (the client's clock start) to its last
               token, on "lane" threads of the "requests" process: a request takes the
               lowest-numbered lane free at its send, so slices on a lane never overlap.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from epsim.model.trace import CounterSample, TrackSlice, lanes, write_chrome_trace

from .simulate import ServingRun, StepRecord

REQUESTS = "requests"

#: side -> the process its ranks are drawn in, when prefill is co-located / disaggregated
RANK_PROCESS = {"colocated": "ranks", "prefill": "prefill ranks", "decode": "decode ranks"}

#: side -> the "KV cache" series its steps' kv_usage feeds
KV_SERIES = {"colocated": "use", "decode": "use", "prefill": "prefill use"}


def rank_slices(steps: list[StepRecord]) -> list[TrackSlice]:
    """A slice per (step, rank that worked in it), on one track per rank of each side."""
    out = []
    for n, s in enumerate(steps):
        process = rank_process(s)
        work = zip(s.rank_prefill_tokens, s.rank_decode_seqs, strict=True)
        for rank, (tokens, seqs) in enumerate(work):
            if tokens:
                name, args = "prefill", {"prompt_tokens": int(tokens)}
            elif seqs:
                name, args = "decode", {"seqs": int(seqs)}
            else:
                continue  # idle this step
            # the next step starts at exactly start_s + seconds: its slice is back to back
            out.append(TrackSlice(name, process, f"rank {rank}", rank, s.start_s * 1e6,
                                  (s.start_s + s.seconds) * 1e6, cat=s.kind,
                                  args={"step": n, "step_kind": s.kind, **args}))
    return out


def counter_samples(steps: list[StepRecord], end_s: float) -> list[CounterSample]:
    """Running / queued requests and KV-cache use at every step's start, all back to 0 at
    ``end_s`` (the last token)."""
    out = []
    for s in sorted(steps, key=lambda s: s.start_s):
        ts = s.start_s * 1e6
        out.append(CounterSample("requests", REQUESTS, ts,
                                 {"running": s.running, "queued": s.queued}))
        out.append(CounterSample("KV cache", REQUESTS, ts, {KV_SERIES[s.role]: s.kv_usage}))
    out.append(CounterSample("requests", REQUESTS, end_s * 1e6, {"running": 0, "queued": 0}))
    out.append(CounterSample("KV cache", REQUESTS, end_s * 1e6,
                             {KV_SERIES[e]: 0.0 for e in dict.fromkeys(s.role for s in steps)}))
    return out


def rank_process(s: StepRecord) -> str:
    """The process a step's ranks are drawn in: instances past the first get their own."""
    process = RANK_PROCESS[s.role]
    return f"{process}, instance {s.instance}" if s.instance else process


def rank_counters(steps: list[StepRecord], end_s: float) -> list[CounterSample]:
    """Each rank's running / queued requests and KV use at its side's steps (those that kept
    them), all back to 0 at ``end_s``."""
    out, processes = [], {}
    for s in sorted(steps, key=lambda s: s.start_s):
        if s.rank_kv_usage is None:
            continue
        process, ts = rank_process(s), s.start_s * 1e6
        processes[process] = len(s.rank_kv_usage)
        for r, (use, running, queued) in enumerate(zip(
                s.rank_kv_usage.tolist(), s.rank_running.tolist(), s.rank_queued.tolist(),
                strict=True)):
            out.append(CounterSample(f"rank {r} requests", process, ts,
                                     {"running": running, "queued": queued}))
            out.append(CounterSample(f"rank {r} KV cache", process, ts, {"use": use}))
    for process, ranks in processes.items():
        for r in range(ranks):
            out.append(CounterSample(f"rank {r} requests", process, end_s * 1e6,
                                     {"running": 0, "queued": 0}))
            out.append(CounterSample(f"rank {r} KV cache", process, end_s * 1e6, {"use": 0.0}))
    return out


def request_lanes(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """A lane per interval so that no two on one lane overlap (``end == start`` is no overlap),
    each taking the lowest-numbered lane free at its start -> (n,) lane ids."""
    return np.array(lanes(zip(start.tolist(), end.tolist(), strict=True)), dtype=np.int64)


def request_slices(run: ServingRun) -> list[TrackSlice]:
    """One slice per request, send to last token, on the lanes of :func:`request_lanes`."""
    req = run.requests
    lanes = request_lanes(run.send_s, run.done_s)
    out = []
    for i in range(len(req)):
        send, first, done = float(run.send_s[i]), float(run.first_token_s[i]), float(run.done_s[i])
        out.append(TrackSlice(
            f"request {i}", REQUESTS, f"lane {lanes[i]}", int(lanes[i]), send * 1e6, done * 1e6,
            cat="request",
            args={"request": i, "input_tokens": int(req.input_lens[i]),
                  "output_tokens": int(req.output_lens[i]), "ttft_ms": (first - send) * 1e3,
                  "e2el_ms": (done - send) * 1e3,
                  "issued_ms": float(req.issue_times_s[i]) * 1e3}))
    return out


def write_serving_trace(run: ServingRun, path: str | os.PathLike[str],
                        metadata: Mapping[str, Any] | None = None) -> None:
    """Write ``run``'s timeline (rank tracks, counters, requests) as Chrome trace JSON, whole or
    not at all."""
    end_s = float(run.done_s.max()) if len(run.done_s) else 0.0
    write_chrome_trace([], path, metadata, slices=rank_slices(run.steps) + request_slices(run),
                       counters=counter_samples(run.steps, end_s)
                       + rank_counters(run.steps, end_s))
