"""Steady-state measurement (``--measure steady``, sim/serving/window.py): the window by hand,
the run sized for it, and closed-loop waves that do or do not desynchronise."""

import numpy as np
import pytest
from serving_models import affine_factory

from epsim.model.errors import EpsimError
from epsim.sim.scenario import StepCache, run_scenario
from epsim.sim.search.slo import parse_slo
from epsim.sim.search.tune import SearchSpace, tune
from epsim.sim.serving.simulate import ServingRun
from epsim.sim.serving.window import (
    STEADY_COMPLETIONS_PER_RANK,
    steady_metrics,
    steady_num_prompts,
    steady_window,
)
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import Requests, WorkloadSpec


def hand_run() -> ServingRun:
    """Six requests of 3 output tokens at concurrency 2, in waves of two: sends 0,0 | 3,4 | 7,8,
    completions 3,4 | 7,8 | 11,12. The burst (0 and 1) waits 2 s for its first token, the
    others 1 s; every request's two gaps are its (E2EL - TTFT) / 2."""
    send = np.array([0.0, 0.0, 3.0, 4.0, 7.0, 8.0])
    done = send + 4.0 - np.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # request 0 done at 3
    first = send + np.array([2.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    gap = (done - first) / 2
    req = Requests(input_lens=np.full(6, 10), output_lens=np.full(6, 3),
                   issue_times_s=np.zeros(6))
    return ServingRun(requests=req, send_s=send, first_token_s=first, done_s=done,
                      itls_s=np.repeat(gap, 2), steps=[], config=None,
                      itl_request_ids=np.repeat(np.arange(6), 2))


def test_the_window_leaves_out_the_burst_and_the_drain():
    run = hand_run()
    w = steady_window(run.send_s, run.done_s, 2)
    # warm-up: the burst's last completion (request 1 at 4 s); cool-down: the last send (8 s)
    assert (w.start_s, w.end_s, w.warmup_requests) == (4.0, 8.0, 2)
    # done in (4, 8]: requests 2 (at 7) and 3 (at 8); 0 and 1 are the burst, 4 and 5 the drain
    assert w.measured.tolist() == [False, False, True, True, False, False]
    m = steady_metrics(run, 2, 1, (50.0,), ("ttft",))
    assert m["mean_ttft_ms"] == pytest.approx(1000.0)  # the burst's 2 s TTFTs left out
    assert m["mean_e2el_ms"] == pytest.approx(4000.0)
    assert m["mean_tpot_ms"] == m["mean_itl_ms"] == pytest.approx(1500.0)
    assert m["duration"] == 4.0
    assert m["request_throughput"] == pytest.approx(2 / 4)
    assert m["output_throughput"] == pytest.approx(2 * 3 / 4)
    assert m["total_token_throughput"] == pytest.approx(2 * 13 / 4)
    assert (m["completed"], m["num_prompts"], m["measure"]) == (6, 6, "steady")
    assert m["window"]["completions"] == 2 and m["window"]["start_s"] == 4.0
    # goodput: of the two, those with TTFT <= 1 s, over the window
    good = steady_metrics(run, 2, 1, (50.0,), ("ttft",), goodput=(("ttft", 1000.0),))
    assert good["request_goodput"] == pytest.approx(2 / 4)


def test_a_run_of_the_burst_alone_has_no_window():
    run = hand_run()
    with pytest.raises(EpsimError, match="no steady window"):
        steady_window(run.send_s[:2], run.done_s[:2], 2)


def test_the_run_is_sized_for_the_window():
    # a closed loop loses about a concurrency to each of warm-up and cool-down
    assert steady_num_prompts(64, 8) == 2 * 64 + STEADY_COMPLETIONS_PER_RANK * 8
    # an open loop without a cap: a tenth each
    assert steady_num_prompts(None, 8) == 160
    # below the ranks, only as many ranks as the cap can be busy: 16 completions each
    assert steady_num_prompts(1, 8) == 2 + STEADY_COMPLETIONS_PER_RANK
    assert steady_num_prompts(4, 8) == 8 + 4 * STEADY_COMPLETIONS_PER_RANK


BASE = Scenario.of(model="deepseek-r1", hardware="mi300x",
                workload=WorkloadSpec(num_prompts=None, isl=1000, osl=30, measure="steady"))


def test_a_steady_run_without_num_prompts_holds_its_completions_per_rank():
    sc = BASE.with_(workload=WorkloadSpec(
        num_prompts=None, isl=1000, osl=30, concurrency=32, measure="steady"))
    r = run_scenario(sc, StepCache(affine_factory(per_seq=1e-3)))
    ranks = r["dp"]
    assert r["num_prompts"] == steady_num_prompts(32, ranks)
    assert r["window"]["completions"] >= STEADY_COMPLETIONS_PER_RANK * ranks


def _mean_ttft(engine: str, n: int, c: int, measure: str) -> float:
    # 8 prompts of 4,000 tokens per rank: 32,000 tokens, several steps' token budget
    w = WorkloadSpec(num_prompts=n, isl=4000, osl=30, concurrency=c, measure=measure)
    sc = Scenario.of(model="deepseek-r1", hardware="mi300x", engine=engine, workload=w)
    return run_scenario(sc, StepCache(affine_factory(per_seq=1e-3, p_token=1e-5)))[
        "mean_ttft_ms"]


def test_sixteen_waves_and_one_differ_in_ttft_where_the_engine_desynchronises():
    c = 64
    # vLLM decodes first and fills the rest of its token budget (max_num_batched_tokens) with
    # prompt chunks: the burst's requests reach their first token in different steps, finish
    # apart, and the waves that follow spread out, each queueing behind less than the burst
    one, many = _mean_ttft("vllm", c, c, "burst"), _mean_ttft("vllm", 16 * c, c, "burst")
    assert many < 0.8 * one
    assert _mean_ttft("vllm", 16 * c, c, "steady") < many  # the burst left out as well
    # SGLang prefills whatever waits before it decodes again (chunk by chunk): a wave's prompts
    # all prefill, then all decode together and finish in one step, so the next wave is sent
    # at once and queues as the burst did
    one, many = _mean_ttft("sglang", c, c, "burst"), _mean_ttft("sglang", 16 * c, c, "burst")
    assert many == pytest.approx(one, rel=1e-9)
    assert _mean_ttft("sglang", 16 * c, c, "steady") == pytest.approx(one, rel=1e-9)


def test_tune_answers_with_a_steady_window():
    space = SearchSpace(concurrency=(8, 32), dbo=(False,))
    res = tune(BASE, parse_slo("mean_ttft_ms<=100000"), space,
               cache=StepCache(affine_factory(per_seq=1e-3)))
    assert res.best is not None and res.best["measure"] == "steady"
    win = res.best["window"]
    assert win["completions"] >= STEADY_COMPLETIONS_PER_RANK * win["ranks"]
    assert win["end_s"] > win["start_s"] and win["warmup_requests"] == res.best["concurrency"]
