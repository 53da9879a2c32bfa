import json

from epsim.model.trace import TraceEvent, write_chrome_trace


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
