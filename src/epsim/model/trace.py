"""The trace schema shared by simulated and measured steps, and its Chrome trace-event writer.

A trace is a list of :class:`TraceEvent`: one executed op (or one simulated op) on one rank and
stream. The simulator and the runtime both emit it with the op graph's ids, so the two traces of
one configuration line up op by op. ``write_chrome_trace`` writes the Chrome trace-event JSON
(``traceEvents``, ``ph: "X"``, ``pid`` = rank, ``tid`` = stream) that Perfetto and
chrome://tracing open.

Timelines above the op level (the serving simulation's steps and requests) use
:class:`TrackSlice` (a slice on a named process and thread) and :class:`CounterSample` (a counter
track, ``ph: "C"``); their processes get the pids after the ranks'.

Times are written in microseconds to ``TS_DECIMALS`` decimals (1 ns). A slice's start and end
are rounded and its duration is their difference, so slices that were back to back stay back to
back (rounding start and duration separately made them overlap by 1 ns).

No two slices on one written track overlap: Perfetto draws partly overlapping slices of one
thread wrongly. Slices that overlap on a stream (under DBO one microbatch's collective is in
flight while the other's is issued) go to extra lanes of it, threads named "comm 2", "comm 3"...
(:func:`lanes`; lane ``k`` of stream ``s`` is ``tid = STREAMS[s] + k * len(STREAMS)``). Only
threads with a slice are named, so no track is empty.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import jsonout
from .outputs import write_text_atomic

#: stream name -> Chrome ``tid``
STREAMS: dict[str, int] = {"compute": 0, "comm": 1, "host": 2}

#: decimals of the microsecond times written: 3 = nanoseconds
TS_DECIMALS = 3


@dataclass(frozen=True)
class TraceEvent:
    """One op's execution on one rank.

    op_id: the op graph's id, e.g. ``"L12.moe.dispatch.mb1"``; ``"launch"`` for host-side costs.
    kind: the op kind (``"dispatch"``).
    rank: global rank. Example: 3.
    stream: ``"compute"``, ``"comm"`` or ``"host"``.
    start_us / dur_us: start and duration in microseconds from the step's start.
    layer / microbatch: as on the op (-1 outside layers).
    args: anything else worth showing (bytes, flops, tokens).
    """

    op_id: str
    kind: str
    rank: int
    stream: str
    start_us: float
    dur_us: float
    layer: int = -1
    microbatch: int = 0
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class TrackSlice:
    """One slice on a named track beside the ranks' op streams (a rank's serving step, a request).

    name: what the slice shows. Example: ``"decode"``, ``"request 17"``.
    process / track: the Perfetto process and thread drawing it. Example: ``"ranks"`` / ``"rank 3"``.
    track_id: the thread's id inside the process (orders the threads). Example: 3.
    start_us / end_us: start and end in microseconds (an end, not a duration, so that a slice
        ending where the next begins is written back to back with it).
    cat / args: the slice's category and what else it shows.
    """

    name: str
    process: str
    track: str
    track_id: int
    start_us: float
    end_us: float
    cat: str = ""
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CounterSample:
    """A counter's values from ``ts_us`` on (Chrome ``ph: "C"``), one series per key; Perfetto
    names a series "<name> <key>". Example: ``CounterSample("requests", "requests", 1500.0,
    {"running": 40, "queued": 8})``."""

    name: str
    process: str
    ts_us: float
    values: Mapping[str, float]


def _span(start_us: float, end_us: float) -> tuple[float, float]:
    """(ts, dur) with ts and the end rounded alike, so ``ts + dur`` is exactly the rounded end."""
    ts, end = round(start_us, TS_DECIMALS), round(end_us, TS_DECIMALS)
    return ts, round(max(end - ts, 0.0), TS_DECIMALS)


def _rounded(start_us: float, end_us: float) -> tuple[float, float]:
    """(start, end) as written: a slice's end is its rounded end, so back to back stays equal
    (``ts + dur`` in floats may land a hair past it)."""
    ts, end = round(start_us, TS_DECIMALS), round(end_us, TS_DECIMALS)
    return ts, max(ts, end)


def lanes(spans: Iterable[tuple[float, float]]) -> list[int]:
    """A lane per ``(start, end)`` span so that no two on one lane overlap (``end == start`` is
    no overlap), each taking the lowest-numbered lane free at its start (ties in input order)."""
    spans = list(spans)
    out = [0] * len(spans)
    busy: list[tuple[float, int]] = []  # (end, lane) of the spans still running
    free: list[int] = []
    used = 0
    for i in sorted(range(len(spans)), key=lambda i: (spans[i][0], i)):
        start, end = spans[i]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane, used = used, used + 1
        out[i] = lane
        heapq.heappush(busy, (end, lane))
    return out


def _track_lanes(keys: list[Any], spans: list[tuple[float, float]]) -> list[int]:
    """:func:`lanes` within each track ``keys[i]`` (spans as written, rounded)."""
    by_key: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    out = [0] * len(keys)
    for members in by_key.values():
        for i, lane in zip(members, lanes(spans[i] for i in members), strict=True):
            out[i] = lane
    return out


def _lane_name(name: str, lane: int) -> str:
    return name if lane == 0 else f"{name} {lane + 1}"


def _named_tracks(slices: list[TrackSlice], counters: list[CounterSample], first_pid: int
                  ) -> list[dict[str, Any]]:
    """The slices and counters as Chrome events, each named process on its own pid from
    ``first_pid`` (in order of first appearance), its threads named."""
    pids: dict[str, int] = {}
    threads: dict[tuple[int, int], str] = {}
    out: list[dict[str, Any]] = []
    for name in [x.process for x in slices] + [c.process for c in counters]:
        pids.setdefault(name, first_pid + len(pids))
    out += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
            for name, pid in pids.items()]
    spans = [_span(x.start_us, x.end_us) for x in slices]
    lane = _track_lanes([(x.process, x.track_id) for x in slices],
                        [_rounded(x.start_us, x.end_us) for x in slices])
    # a track's extra lanes take ids past every track id of its process
    stride: dict[int, int] = {}
    for x in slices:
        stride[pids[x.process]] = max(stride.get(pids[x.process], 0), x.track_id + 1)
    tids = [x.track_id + k * stride[pids[x.process]] for x, k in zip(slices, lane, strict=True)]
    for x, k, tid in zip(slices, lane, tids, strict=True):
        threads.setdefault((pids[x.process], tid), _lane_name(x.track, k))
    out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for (pid, tid), name in sorted(threads.items())]
    for x, (ts, dur), tid in zip(slices, spans, tids, strict=True):
        out.append({"name": x.name, "cat": x.cat, "ph": "X", "pid": pids[x.process],
                    "tid": tid, "ts": ts, "dur": dur, "args": dict(x.args)})
    out += [{"name": c.name, "ph": "C", "pid": pids[c.process], "tid": 0,
             "ts": round(c.ts_us, TS_DECIMALS), "args": dict(c.values)} for c in counters]
    return out


def to_chrome_trace(events: Iterable[TraceEvent], metadata: Mapping[str, Any] | None = None, *,
                    slices: Iterable[TrackSlice] = (), counters: Iterable[CounterSample] = ()
                    ) -> dict[str, Any]:
    """The Chrome trace-event object for ``events`` (plus named-track ``slices`` and
    ``counters``)."""
    events = list(events)
    for e in events:
        if e.stream not in STREAMS:
            raise ValueError(f"unknown stream {e.stream!r} for {e.op_id}")
    spans = [_span(e.start_us, e.end_us) for e in events]
    lane = _track_lanes([(e.rank, e.stream) for e in events],
                        [_rounded(e.start_us, e.end_us) for e in events])
    tids = [STREAMS[e.stream] + k * len(STREAMS) for e, k in zip(events, lane, strict=True)]
    threads = {(e.rank, tid): _lane_name(e.stream, k)
               for e, k, tid in zip(events, lane, tids, strict=True)}
    out: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})
    out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for (pid, tid), name in sorted(threads.items())]
    for e, (ts, dur), tid in zip(events, spans, tids, strict=True):
        out.append({
            "name": e.op_id, "cat": e.kind, "ph": "X", "pid": e.rank, "tid": tid,
            "ts": ts, "dur": dur,
            "args": {"layer": e.layer, "microbatch": e.microbatch, **dict(e.args)},
        })
    first_pid = max((e.rank for e in events), default=-1) + 1
    out += _named_tracks(list(slices), list(counters), first_pid)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_json_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` as JSON to ``path`` whole or not at all (:func:`write_text_atomic`)."""
    write_text_atomic(jsonout.dumps(obj), path)


def write_chrome_trace(events: Iterable[TraceEvent], path: str | os.PathLike[str],
                       metadata: Mapping[str, Any] | None = None, *,
                       slices: Iterable[TrackSlice] = (),
                       counters: Iterable[CounterSample] = ()) -> None:
    """Write ``events`` (plus ``slices`` and ``counters``) as Chrome trace-event JSON, whole or
    not at all."""
    write_json_atomic(to_chrome_trace(events, metadata, slices=slices, counters=counters), path)
