"""Every trace writer's tracks draw right in Perfetto: no two slices on one track partly overlap
(disjoint or nested only) and every named track and process has an event. The writers: the op
trace of ``epsim step --trace`` and ``epsim run --trace`` (model/trace.py) and the serving trace
of ``predict --trace`` (sim/serving/trace.py)."""

import json
from decimal import Decimal

import numpy as np
import pytest
from serving_models import Affine

from epsim.model.trace import TraceEvent, TrackSlice, lanes, to_chrome_trace, write_chrome_trace
from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving.trace import write_serving_trace
from epsim.sim.workload.spec import Requests


def track_problems(data: dict) -> list[tuple]:
    """Partial overlaps on a (pid, tid) track, named threads without a slice, and named
    processes without a slice or counter."""
    tracks, threads, procs, used = {}, set(), set(), set()
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
            used.add(e["pid"])
        elif e["ph"] == "C":
            used.add(e["pid"])
        elif e["name"] == "thread_name":
            threads.add((e["pid"], e["tid"]))
        elif e["name"] == "process_name":
            procs.add(e["pid"])
    out = []
    for key, spans in tracks.items():
        open_ends: list = []  # ends of the slices enclosing the current one, innermost last
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            if open_ends and end > open_ends[-1]:
                out.append(("partial overlap", key, start, end, open_ends[-1]))
            open_ends.append(end)
    out += [("empty thread", k) for k in sorted(threads - set(tracks))]
    out += [("empty process", p) for p in sorted(procs - used)]
    return out


def _load(path) -> dict:
    return json.loads(path.read_text(), parse_float=Decimal)


def test_the_checker_sees_partial_overlaps_and_empty_tracks():
    x = {"ph": "X", "pid": 0, "tid": 1}
    data = {"traceEvents": [
        {**x, "ts": 0, "dur": 10}, {**x, "ts": 2, "dur": 3}, {**x, "ts": 5, "dur": 10},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 2, "args": {"name": "host"}},
        {"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "idle"}}]}
    # [2, 5) nests in [0, 10); [5, 15) overlaps it partly
    assert track_problems(data) == [("partial overlap", (0, 1), 5, 15, 10),
                                    ("empty thread", (0, 2)), ("empty process", 7)]


def test_lanes_reuse_the_lowest_free_lane():
    # 0 ends as 2 starts (lane 0 again); 3 needs a new lane; 4 takes lane 0 after 2 ended
    assert lanes([(0, 1), (0, 3), (1, 2), (1, 2.5), (2.5, 3)]) == [0, 1, 0, 2, 0]


def test_overlapping_collectives_go_to_lanes_of_their_stream():
    ev = [TraceEvent("mb0.dispatch", "dispatch", 0, "comm", 0.0, 10.0),
          TraceEvent("mb1.dispatch", "dispatch", 0, "comm", 5.0, 10.0),  # in flight with mb0's
          TraceEvent("mb0.combine", "combine", 0, "comm", 10.0, 10.0),  # after mb0's ended
          TraceEvent("mb0.gemm", "gemm", 0, "compute", 0.0, 1.0)]
    out = to_chrome_trace(ev)
    xs = {e["name"]: e["tid"] for e in out["traceEvents"] if e["ph"] == "X"}
    assert xs == {"mb0.dispatch": 1, "mb1.dispatch": 4, "mb0.combine": 1, "mb0.gemm": 0}
    names = {e["tid"]: e["args"]["name"] for e in out["traceEvents"]
             if e["name"] == "thread_name"}
    assert names == {0: "compute", 1: "comm", 4: "comm 2"}  # no empty host track
    assert track_problems(out) == []


def test_overlapping_named_slices_go_to_lanes_past_the_process_tracks(tmp_path):
    sl = [TrackSlice("a", "ranks", "rank 0", 0, 0.0, 4.0),
          TrackSlice("b", "ranks", "rank 0", 0, 2.0, 6.0),
          TrackSlice("c", "ranks", "rank 1", 1, 0.0, 6.0)]
    path = tmp_path / "t.json"
    write_chrome_trace([], path, slices=sl)
    data = _load(path)
    tids = {e["name"]: e["tid"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert tids == {"a": 0, "b": 2, "c": 1}  # tracks 0..1, so rank 0's second lane is 2
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 0 2"}
    assert track_problems(data) == []


def test_step_trace_tracks(epsim, tmp_path):
    path = tmp_path / "step.json"
    out = epsim("step", "--model", "tiny-deepseek", "--hardware", "mi300x", "--dp", "8", "--ep",
                "8", "--batch", "8", "--context", "64", "--dbo", "--trace", str(path))
    assert out.returncode == 0, out.stderr
    data = _load(path)
    assert {e["pid"] for e in data["traceEvents"] if e["ph"] == "X"} == set(range(8))
    assert track_problems(data) == []


def _serving_runs():
    n = 12
    req = Requests(np.full(n, 100), np.full(n, 6), np.linspace(0.0, 0.2, n))
    yield simulate_serving(req, ServingConfig(dp=2, kv_capacity_tokens=250, instances=2),
                           Affine(base=0.01, p_base=0.1), concurrency=8)
    cfg = ServingConfig(dp=2, kv_capacity_tokens=10**6, prefill_dp=2,
                        prefill_kv_capacity_tokens=10**6, kv_transfer_s_per_token=1e-4)
    yield simulate_serving(req, cfg, Affine(base=0.01), Affine(p_base=0.2), concurrency=8)


@pytest.mark.parametrize("which", [0, 1], ids=["colocated-2-instances", "disaggregated"])
def test_serving_trace_tracks(tmp_path, which):
    run = list(_serving_runs())[which]
    path = tmp_path / "serve.json"
    write_serving_trace(run, path)
    data = _load(path)
    procs = {e["pid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["name"] == "process_name"}
    per_rank = {(procs[e["pid"]], e["name"]) for e in data["traceEvents"] if e["ph"] == "C"
                and e["name"].startswith("rank ")}
    rank_procs = {p for p in procs.values() if p != "requests"}
    # every rank process carries its ranks' counters
    assert per_rank == {(p, f"rank {r} {what}") for p in rank_procs for r in (0, 1)
                        for what in ("requests", "KV cache")}
    assert len(rank_procs) == 2
    assert track_problems(data) == []


def test_runtime_dbo_trace_tracks(epsim, tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "run.json"
    out = epsim("run", "--model", "tiny-deepseek", "--world-size", "2", "--batch", "4",
                "--context", "8", "--steps", "2", "--dbo", "--trace", str(path), timeout=120)
    assert out.returncode == 0, out.stderr
    data = _load(path)
    comm = [e for e in data["traceEvents"] if e["ph"] == "X" and e.get("cat") == "dispatch"]
    assert {e["pid"] for e in comm} == {0, 1}
    assert track_problems(data) == []
