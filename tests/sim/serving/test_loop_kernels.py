"""The serving loop's compiled passes against the numpy expressions they replace, element for
element (sim/serving/loop_kernels.py), and the gap log's buffered counting against counting per emit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from serving_models import Affine, assert_same_metrics

from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving import tally as run_tally
from epsim.sim.serving.loop_kernels import (
    emit_tokens,
    off_ranks,
    rank_batches,
    rank_counts,
    without,
)
from epsim.sim.serving.metrics import compute_metrics
from epsim.sim.serving.tally import GapLog
from epsim.sim.workload.spec import Requests


def _state(seed: int, n: int, ranks: int):
    rng = np.random.default_rng(seed)
    rank = rng.integers(0, ranks, n)
    isl = rng.integers(1, 5000, n)
    generated = rng.integers(0, 300, n)
    osl = generated + rng.integers(0, 3, n)
    # a few distinct last-output times, as the steps leave them
    last = rng.choice(rng.uniform(0.0, 50.0, 4), n)
    ids = rng.permutation(n)[: rng.integers(1, n + 1)]
    return rng, rank, isl, generated, osl, last, ids


@settings(max_examples=60, deadline=None)
@given(hs.integers(0, 10_000), hs.integers(1, 300), hs.integers(1, 9), hs.booleans())
def test_emit_tokens_is_numpys_emit(seed, n, ranks, with_counts):
    rng, _, _, generated, osl, last, ids = _state(seed, n, ranks)
    counts = rng.integers(1, 3, len(ids)) if with_counts else None
    t = 60.0
    # numpy's emit (RequestState.emit with the per-request lists)
    gaps = t - last[ids]
    want_last, want_gen = last.copy(), generated.copy()
    want_last[ids] = t
    want_gen[ids] += 1 if counts is None else counts
    want_done = ids[want_gen[ids] >= osl[ids]]

    rest = np.full(len(ids) + 5, -1.0)
    g0, same, filled, done = emit_tokens(ids, t, last, generated, osl, counts, rest, 5)
    assert g0 == gaps[0] and same == int(np.count_nonzero(gaps == gaps[0]))
    assert rest[5:filled].tolist() == gaps[gaps != gaps[0]].tolist()
    assert filled - 5 == len(ids) - same and rest[:5].tolist() == [-1.0] * 5
    assert last.tolist() == want_last.tolist() and generated.tolist() == want_gen.tolist()
    assert done.tolist() == want_done.tolist()


@settings(max_examples=60, deadline=None)
@given(hs.integers(0, 10_000), hs.integers(1, 300), hs.integers(1, 9))
def test_rank_passes_are_numpys(seed, n, ranks):
    _, rank, isl, generated, _, _, ids = _state(seed, n, ranks)
    seqs, ctx = rank_batches(ids, rank, isl, generated, ranks)
    assert seqs.tolist() == np.bincount(rank[ids], minlength=ranks).tolist()
    # bit for bit: the same float sums in the same order
    want = np.bincount(rank[ids], weights=(isl[ids] + generated[ids]).astype(np.float64),
                       minlength=ranks)
    assert ctx.tolist() == want.tolist()
    assert rank_counts(ids, rank, ranks).tolist() == seqs.tolist()
    excluded = np.arange(ranks) % 2 == 0
    assert off_ranks(ids, rank, excluded).tolist() == ids[~excluded[rank[ids]]].tolist()
    mark = np.zeros(n, dtype=bool)
    gone = ids[::3]
    assert without(ids, gone, mark).tolist() == ids[~np.isin(ids, gone)].tolist()
    assert not mark.any()  # the marks are cleared for the next call


def test_rank_passes_by_hand():
    ids = np.array([4, 0, 2])
    rank = np.array([1, 0, 1, 0, 0])
    isl, generated = np.array([10, 0, 30, 0, 50]), np.array([1, 0, 2, 0, 3])
    seqs, ctx = rank_batches(ids, rank, isl, generated, 3)
    # request 4 on rank 0 (50 + 3), requests 0 and 2 on rank 1 (10 + 1, then 30 + 2)
    assert seqs.tolist() == [1, 2, 0] and ctx.tolist() == [53.0, 43.0, 0.0]
    assert off_ranks(ids, rank, np.array([True, False, False])).tolist() == [0, 2]
    assert rank_counts(np.zeros(0, dtype=np.int64), rank, 2).tolist() == [0, 0]


def test_gap_log_counts_the_same_when_its_buffer_fills(monkeypatch):
    rng = np.random.default_rng(5)
    emits = [(np.round(rng.choice([0.1, 0.2, 0.35], rng.integers(1, 40)), 2), int(k % 2))
             for k in range(200)]

    def log_of(buffered: bool) -> run_tally.Gaps:
        log = GapLog(keep_requests=False)
        for k, (gaps, instance) in enumerate(emits):
            if not buffered:
                log.add(gaps, np.arange(len(gaps)), float(k), instance)
                continue
            rest, n = log.rest_buffer(instance, len(gaps))
            others = gaps[gaps != gaps[0]]
            rest[n:n + len(others)] = others
            log.add_counted(float(gaps[0]), len(gaps) - len(others), len(gaps),
                            n + len(others), float(k), instance)
        return log.finish()

    monkeypatch.setattr(run_tally, "REST_BUFFER_GAPS", 16)  # counted many times over
    a, b = log_of(False), log_of(True)
    for instance in (None, 0, 1):
        pa, pb = a.population(instance), b.population(instance)
        assert len(pa) == len(pb) > 0
        assert pb.percentile([0, 10, 50, 90, 99, 100]).tolist() == \
            pa.percentile([0, 10, 50, 90, 99, 100]).tolist()
        assert pb.mean() == pytest.approx(pa.mean(), rel=1e-12)
    assert b.emit_n.tolist() == a.emit_n.tolist() and b.emit_t.tolist() == a.emit_t.tolist()


def test_a_lean_run_counting_its_gaps_in_a_small_buffer_gives_the_same_metrics(monkeypatch):
    rng = np.random.default_rng(1)
    n = 200
    req = Requests(input_lens=rng.integers(50, 400, n), output_lens=rng.integers(1, 60, n),
                   issue_times_s=np.sort(rng.uniform(0, 3, n)))
    cfg = ServingConfig(dp=4, kv_capacity_tokens=20_000, chunked_prefill_size=512)
    model = Affine(per_seq=1e-4, per_ctx=1e-8, p_token=1e-5)
    full = compute_metrics(simulate_serving(req, cfg, model, details=True))
    monkeypatch.setattr(run_tally, "REST_BUFFER_GAPS", 8)
    assert_same_metrics(full, compute_metrics(simulate_serving(req, cfg, model, details=False)))


def test_running_counts_kept_as_requests_join_and_leave_equal_a_fresh_count(monkeypatch):
    from epsim.sim.serving import state as serving_state

    checked = []
    count = serving_state.Running.count

    def checked_count(self, st):
        kept = count(self, st)
        assert kept.tolist() == np.bincount(st.rank[self.ids], minlength=self.ranks).tolist()
        checked.append(1)
        return kept

    monkeypatch.setattr(serving_state.Running, "count", checked_count)
    rng = np.random.default_rng(2)
    n = 300
    req = Requests(input_lens=rng.integers(50, 2000, n), output_lens=rng.integers(1, 200, n),
                   issue_times_s=np.sort(rng.uniform(0, 2, n)))
    # a small KV pool: vLLM preempts (requests leave the running set and join again)
    for scheduler in ("prefill_first", "decode_first", "sglang"):
        cfg = ServingConfig(dp=4, kv_capacity_tokens=6_000, chunked_prefill_size=512,
                            scheduler=scheduler)
        simulate_serving(req, cfg, Affine(per_seq=1e-4, per_ctx=1e-8, p_token=1e-5),
                         details=False)
    assert len(checked) > 100
