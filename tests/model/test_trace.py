import itertools
import json
from decimal import Decimal

from hypothesis import example, given, settings
from hypothesis import strategies as st

from epsim.model.trace import CounterSample, TraceEvent, TrackSlice, write_chrome_trace


def test_chrome_trace_round_trip(tmp_path):
    events = [
        TraceEvent("L3.attn.core.mb0", "attention_decode", rank=0, stream="compute",
                   start_us=0.0, dur_us=10.0, layer=3),
        TraceEvent("L3.moe.dispatch.mb0", "dispatch", rank=1, stream="comm", start_us=5.0,
                   dur_us=20.0, layer=3, args={"bytes": 100}),
    ]
    path = tmp_path / "t.json"
    write_chrome_trace(events, path, {"model": "tiny"})
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["tid"]) for e in xs] == [
        ("L3.attn.core.mb0", 0, 0), ("L3.moe.dispatch.mb0", 1, 1)]
    assert xs[1]["args"]["bytes"] == 100 and xs[1]["dur"] == 20.0
    names = {(e["pid"], e["args"]["name"]) for e in data["traceEvents"] if e["ph"] == "M"}
    assert (1, "comm") in names and (0, "rank 0") in names
    assert data["otherData"]["model"] == "tiny"


def test_write_is_atomic_on_failure(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("old")
    bad = [TraceEvent("x", "gemm", 0, "nowhere", 0, 1)]
    try:
        write_chrome_trace(bad, path)
    except ValueError:
        pass
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def _slices_by_track(path):
    """Every X event per (pid, tid), times exactly as written (decimals, not floats)."""
    data = json.loads(path.read_text(), parse_float=Decimal)
    tracks = {}
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["dur"]))
    return tracks


@settings(max_examples=200, deadline=None)
@given(start=st.floats(0, 1e9, allow_nan=False),
       durs=st.lists(st.floats(0, 1e4, allow_nan=False), min_size=2, max_size=30))
@example(start=0.0006, durs=[0.0006, 0.0006])  # rounding ts and dur apart overlapped by 1 ns
def test_back_to_back_events_never_overlap_once_written(tmp_path_factory, start, durs):
    events, slices, t = [], [], start
    for i, d in enumerate(durs):  # each starts where the previous ended, as the simulator has it
        events.append(TraceEvent(f"op{i}", "gemm", rank=0, stream="compute", start_us=t,
                                 dur_us=d))
        slices.append(TrackSlice(f"s{i}", "ranks", "rank 0", 0, t, t + d))
        t = t + d
    path = tmp_path_factory.mktemp("trace") / "t.json"
    write_chrome_trace(events, path, slices=slices)
    tracks = _slices_by_track(path)
    assert sorted(len(v) for v in tracks.values()) == [len(durs)] * 2
    for spans in tracks.values():
        for (ts, dur), (next_ts, _) in itertools.pairwise(spans):
            assert dur >= 0 and ts + dur <= next_ts
        # back to back stays back to back: no gap appears either
        assert all(ts + dur == nxt for (ts, dur), (nxt, _) in itertools.pairwise(spans))


def test_counters_and_named_tracks(tmp_path):
    path = tmp_path / "t.json"
    write_chrome_trace(
        [TraceEvent("op", "gemm", rank=1, stream="compute", start_us=0.0, dur_us=1.0)], path,
        slices=[TrackSlice("request 0", "requests", "lane 0", 0, 1.0, 3.5)],
        counters=[CounterSample("requests", "requests", 1.0, {"running": 1, "queued": 0})])
    ev = json.loads(path.read_text())["traceEvents"]
    names = {(e["pid"], e["name"]): e["args"]["name"] for e in ev if e["ph"] == "M"}
    # ranks keep their pids; the named process takes the next one
    assert names[(1, "process_name")] == "rank 1" and names[(2, "process_name")] == "requests"
    assert names[(2, "thread_name")] == "lane 0"
    (x,) = [e for e in ev if e["ph"] == "X" and e["pid"] == 2]
    assert (x["ts"], x["dur"], x["tid"]) == (1.0, 2.5, 0)
    (c,) = [e for e in ev if e["ph"] == "C"]
    assert c == {"name": "requests", "ph": "C", "pid": 2, "tid": 0, "ts": 1.0,
                 "args": {"running": 1, "queued": 0}}
