"""The run's tallies: weighted populations against numpy on the expanded values, the gap log,
and a run without details giving the same metrics as one with."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from serving_models import Affine, assert_same_metrics

from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving.metrics import compute_metrics, latency_stats
from epsim.sim.serving.tally import GapLog, Weighted
from epsim.sim.workload.spec import Requests

PCTS = [0.0, 1.0, 10.0, 25.0, 50.0, 75.0, 90.0, 99.0, 99.9, 100.0]


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.tuples(hs.floats(1e-4, 10.0, allow_nan=False), hs.integers(1, 50)),
                min_size=1, max_size=40))
def test_weighted_equals_numpy_on_the_expanded_values(pairs):
    values = np.array([v for v, _ in pairs])
    counts = np.array([c for _, c in pairs])
    expanded = np.repeat(values, counts)
    w = Weighted(values, counts)
    assert len(w) == len(expanded)
    # order statistics are exact: the same floats numpy gives
    assert w.percentile(PCTS).tolist() == np.percentile(expanded, PCTS).tolist()
    assert w.median() == float(np.median(expanded))
    assert w.mean() == pytest.approx(float(np.mean(expanded)), rel=1e-12)
    assert w.std() == pytest.approx(float(np.std(expanded)), rel=1e-9, abs=1e-12)


def test_weighted_by_hand():
    # 0.1 x3, 0.3 x1: sorted [0.1, 0.1, 0.1, 0.3]; p50 = (0.1 + 0.1) / 2, p90 at index 2.7
    w = Weighted(np.array([0.3, 0.1]), np.array([1, 3]))
    assert w.median() == pytest.approx(0.1)
    assert w.percentile([90.0])[0] == pytest.approx(0.1 + 0.7 * 0.2)
    assert w.mean() == pytest.approx(0.15)
    assert w.std() == pytest.approx(np.sqrt((3 * 0.05 ** 2 + 0.15 ** 2) / 4))


def test_latency_stats_agree_for_arrays_and_populations():
    rng = np.random.default_rng(3)
    values = rng.choice([0.08, 0.081, 0.2, 0.5], size=999)
    uniq, counts = np.unique(values, return_counts=True)
    a = latency_stats("itl", values, PCTS, True)
    b = latency_stats("itl", Weighted(uniq, counts), PCTS, True)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-12), k


def test_gap_log_keeps_the_shared_gap_once_per_emit():
    log = GapLog(keep_requests=False)
    log.first_tokens(0.5, 1)
    # three requests share the step's gap, one joined since (0.4)
    log.add(np.array([0.1, 0.1, 0.4, 0.1]), np.array([0, 1, 3, 2]), 1.0, 0)
    log.add(np.array([0.2]), np.array([0]), 1.2, 1)
    gaps = log.finish()
    # each emit's first gap with its count, then its other values with theirs
    assert gaps.values.tolist() == [0.1, 0.2, 0.4]
    assert gaps.counts.tolist() == [3, 1, 1]
    assert gaps.instance.tolist() == [0, 1, 0]
    assert gaps.raw is None and gaps.raw_request_ids is None
    assert len(gaps.population()) == 5 and len(gaps.population(1)) == 1
    # outputs: 1 at 0.5 and 4 at 1.0 in second 0 (from 0.0), 1 at 1.2 in second 1
    assert gaps.peak_outputs_per_s(0.0, 1.2) == 5.0


def test_a_run_without_details_gives_the_same_metrics():
    rng = np.random.default_rng(0)
    n = 300
    req = Requests(input_lens=rng.integers(50, 400, n), output_lens=rng.integers(1, 60, n),
                   issue_times_s=np.sort(rng.uniform(0, 3, n)))
    cfg = ServingConfig(dp=4, kv_capacity_tokens=20_000, chunked_prefill_size=512)
    full = simulate_serving(req, cfg, Affine(per_seq=1e-4, per_ctx=1e-8, p_token=1e-5), details=True)
    lean = simulate_serving(req, cfg, Affine(per_seq=1e-4, per_ctx=1e-8, p_token=1e-5), details=False)
    assert len(full.steps) > 50 and lean.steps == [] and lean.itls_s is None
    assert len(full.itls_s) == int((req.output_lens - 1).sum())
    # far fewer kept values than gaps: one per distinct gap of a step
    assert len(lean.gaps.values) < len(full.itls_s) / 3
    assert_same_metrics(compute_metrics(full), compute_metrics(lean))


def test_progress_is_reported_as_requests_finish():
    n = 1000
    req = Requests(input_lens=np.full(n, 100), output_lens=np.full(n, 5),
                   issue_times_s=np.linspace(0, 50, n))
    seen = []
    simulate_serving(req, ServingConfig(dp=2, kv_capacity_tokens=50_000), Affine(p_base=0.001),
                     details=False, progress=lambda done, total: seen.append((done, total)))
    done = [d for d, _ in seen]
    assert seen[-1] == (n, n) and all(t == n for _, t in seen)
    assert done == sorted(done) and len(set(done)) == len(done)
    # about every 1/200 of the requests (5 here; a step may finish several), not per request
    assert 100 <= len(seen) <= 201


def test_reserved_places_tie_after_the_events_queued_before_them():
    from epsim.sim.serving.state import EventLoop

    loop, order = EventLoop(), []
    loop.at(1.0, lambda t: order.append("early"))
    base = loop.reserve(2)
    loop.at(1.0, lambda t: order.append("second"), place=base + 1)
    loop.at(1.0, lambda t: order.append("first"), place=base)
    loop.at(1.0, lambda t: order.append("late"))
    loop.run()
    assert order == ["early", "first", "second", "late"]


def test_a_stream_fires_in_the_places_it_reserved():
    from epsim.sim.serving.state import EventLoop

    loop, order = EventLoop(), []
    loop.at(1.0, lambda t: order.append(("early", t)))
    loop.stream([0.5, 1.0, 2.0], lambda t: order.append(("stream", t)))
    loop.at(1.0, lambda t: order.append(("late", t)))
    # an event a stream callback adds at its own time comes after the stream's later places
    loop.at(0.7, lambda t: loop.at(2.0, lambda t2: order.append(("added", t2))))
    loop.run()
    assert order == [("stream", 0.5), ("early", 1.0), ("stream", 1.0), ("late", 1.0),
                     ("stream", 2.0), ("added", 2.0)]


def test_weighted_mean_and_std_do_not_depend_on_blas_threads():
    # a BLAS dot splits a long sum over its threads, so its last bit followed the thread count
    # (a search worker runs one): the sums are numpy's own, the same under any limit
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(7)
    w = Weighted(rng.random(200_000) * 100, rng.integers(1, 5, 200_000))
    with threadpool_limits(limits=1, user_api="blas"):
        one = (w.mean(), w.std())
    with threadpool_limits(limits=2, user_api="blas"):
        two = (w.mean(), w.std())
    assert one == two
    expanded = np.repeat(w.values, w.counts)
    assert one == pytest.approx((expanded.mean(), expanded.std()), rel=1e-12)
