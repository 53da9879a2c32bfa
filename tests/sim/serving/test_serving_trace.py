"""The serving trace (``predict --trace``): rank tracks, counters, one slice per request."""

import itertools
import json
from decimal import Decimal

import numpy as np
import pytest
from serving_models import Affine

from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving.trace import request_lanes, write_serving_trace
from epsim.sim.workload.spec import Requests


def reqs(n, isl, osl):
    return Requests(np.full(n, isl), np.full(n, osl), np.zeros(n))


def _trace(run, tmp_path):
    path = tmp_path / "serve.json"
    write_serving_trace(run, path, {"model": "analytic"})
    data = json.loads(path.read_text(), parse_float=Decimal)
    ev = data["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    threads = {(procs[e["pid"]], e["tid"]): e["args"]["name"] for e in ev
               if e["name"] == "thread_name"}
    slices = [{**e, "process": procs[e["pid"]]} for e in ev if e["ph"] == "X"]
    counters = [{**e, "process": procs[e["pid"]]} for e in ev if e["ph"] == "C"]
    return data, threads, slices, counters


def test_colocated_trace_by_hand(tmp_path):
    # dp 2, room for one 105-token request per rank: 2 run, 2 wait in the ranks' queues
    run = simulate_serving(reqs(6, 100, 5), ServingConfig(dp=2, kv_capacity_tokens=105),
                           Affine(base=0.01, p_base=0.1), concurrency=4)
    data, threads, slices, counters = _trace(run, tmp_path)
    assert data["otherData"] == {"model": "analytic"}
    # one track per rank
    assert {t: n for t, n in threads.items() if t[0] == "ranks"} == {
        ("ranks", 0): "rank 0", ("ranks", 1): "rank 1"}
    ranks = [s for s in slices if s["process"] == "ranks"]
    assert {s["name"] for s in ranks} == {"prefill", "decode"}
    for n, step in enumerate(run.steps):  # each rank's share of each step
        mine = [s for s in ranks if s["args"]["step"] == n]
        assert sum(s["args"].get("prompt_tokens", 0) for s in mine) == step.prefill_tokens
        assert sum(s["args"].get("seqs", 0) for s in mine) == step.decode_tokens
    # the three counter series, sampled at every step and once at the end
    series = {(c["name"], k) for c in counters if c["process"] == "requests" for k in c["args"]}
    assert series == {("requests", "running"), ("requests", "queued"), ("KV cache", "use")}
    reqc = [c["args"] for c in counters if c["name"] == "requests"]
    assert len(reqc) == len(run.steps) + 1
    assert reqc[0] == {"running": 2, "queued": 2}  # 4 sent, one admitted per rank
    assert max(c["running"] for c in reqc) == 2 and reqc[-1] == {"running": 0, "queued": 0}
    kv = [c["args"]["use"] for c in counters if c["name"] == "KV cache"]
    assert kv[0] == 1  # both ranks' caches hold a whole request
    # per rank, on the ranks' process: one running and one queued on each at the first step
    per_rank = {}
    for c in counters:
        if c["process"] == "ranks":
            per_rank.setdefault(c["name"], []).append(c["args"])
    assert set(per_rank) == {"rank 0 requests", "rank 1 requests", "rank 0 KV cache",
                             "rank 1 KV cache"}
    for r in (0, 1):
        reqs_r, kv_r = per_rank[f"rank {r} requests"], per_rank[f"rank {r} KV cache"]
        assert reqs_r[0] == {"running": 1, "queued": 1} and kv_r[0] == {"use": 1}
        assert reqs_r[-1] == {"running": 0, "queued": 0} and kv_r[-1] == {"use": 0}
        assert len(reqs_r) == len(kv_r) == len(run.steps) + 1
    # the ranks' counts add up to the global ones at every step
    for n in range(len(run.steps)):
        assert sum(per_rank[f"rank {r} requests"][n]["running"] for r in (0, 1)) == \
            reqc[n]["running"]
    # one slice per request, send to last token
    req = sorted((s for s in slices if s["process"] == "requests"),
                 key=lambda s: s["args"]["request"])
    assert [s["name"] for s in req] == [f"request {i}" for i in range(6)]
    for s, send, done in zip(req, run.send_s, run.done_s, strict=True):
        assert float(s["ts"]) == pytest.approx(send * 1e6)
        assert float(s["dur"]) == pytest.approx((done - send) * 1e6)
        assert s["args"]["e2el_ms"] == pytest.approx(float(s["dur"]) / 1e3)
    # at most 4 in flight: 4 lanes, none holding two requests at once
    lanes = {}
    for s in req:
        lanes.setdefault(s["tid"], []).append((s["ts"], s["dur"]))
    assert len(lanes) == 4
    for spans in lanes.values():
        spans.sort()
        assert all(a + d <= b for (a, d), (b, _) in itertools.pairwise(spans))


def test_disaggregated_trace_has_both_sides(tmp_path):
    cfg = ServingConfig(dp=2, kv_capacity_tokens=10**6, prefill_dp=1,
                        prefill_kv_capacity_tokens=10**6, kv_transfer_s_per_token=1e-4)
    run = simulate_serving(reqs(5, 100, 3), cfg, Affine(base=0.01), Affine(p_base=0.2),
                           concurrency=5)
    _, threads, slices, counters = _trace(run, tmp_path)
    assert {t for t in threads if t[0] != "requests"} == {
        ("prefill ranks", 0), ("decode ranks", 0), ("decode ranks", 1)}
    assert {s["name"] for s in slices if s["process"] == "prefill ranks"} == {"prefill"}
    assert {s["name"] for s in slices if s["process"] == "decode ranks"} == {"decode"}
    assert {k for c in counters if c["name"] == "KV cache" for k in c["args"]} == {
        "use", "prefill use"}
    assert len([s for s in slices if s["process"] == "requests"]) == 5


def test_request_lanes_reuse_the_lowest_free_lane():
    start = np.array([0.0, 0.0, 1.0, 1.0, 2.5])
    end = np.array([1.0, 3.0, 2.0, 2.5, 3.0])
    # 0 ends as 2 starts (lane 0 again); 3 needs a new lane; 4 takes lane 0 after 2 ended
    assert request_lanes(start, end).tolist() == [0, 1, 0, 2, 0]


def test_per_rank_counts_are_kept_only_when_asked():
    cfg = ServingConfig(dp=2, kv_capacity_tokens=10**4)
    kept = simulate_serving(reqs(4, 100, 5), cfg, Affine(base=0.01), concurrency=4)
    assert kept.steps[0].rank_running.tolist() == [2, 2]  # round robin: two on each rank
    assert kept.steps[0].rank_queued.tolist() == [0, 0]
    assert kept.steps[0].rank_kv_usage.tolist() == [0.021, 0.021]  # 2 x 105 of 10,000
    # a search keeps its steps for a steady window, without the O(requests) counts a step
    lean = simulate_serving(reqs(4, 100, 5), cfg, Affine(base=0.01), concurrency=4,
                            rank_counts=False)
    assert len(lean.steps) == len(kept.steps)
    assert all(s.rank_running is None and s.rank_kv_usage is None for s in lean.steps)
