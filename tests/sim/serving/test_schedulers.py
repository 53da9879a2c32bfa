"""The scheduler classes: each policy's next step on hand-built queues, and KV pressure
(vLLM's preemption, SGLang's retraction) on small runs whose timelines are computed by hand."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_models import Affine

from epsim.model.errors import EpsimError
from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving.config import COLOCATED
from epsim.sim.serving.kv_pools import WholeSequence
from epsim.sim.serving.schedulers import SCHEDULERS, Counters, scheduler_class
from epsim.sim.serving.state import RequestState, SideQueues
from epsim.sim.workload.spec import Requests


def hand_built(name, capacity=10**6, **cfg):
    """Two ranks, 1000-token chunks. Rank 0: requests 0 and 1 (600-token prompts) queued,
    request 2 decoding; rank 1: request 3 decoding. Every request wants 5 output tokens."""
    cls = scheduler_class(name)
    req = Requests(np.array([600, 600, 10, 10]), np.array([5, 5, 5, 5]), np.zeros(4))
    state = RequestState(req)
    state.rank[:] = [0, 0, 0, 1]
    config = ServingConfig(dp=2, kv_capacity_tokens=capacity, chunked_prefill_size=1000,
                           scheduler=name, **cfg)
    q = SideQueues(2, 1000)
    q.queues[0].extend([0, 1])
    kv = cls.make_kv(2, capacity, state, state.rank, config)
    for i in (2, 3):
        state.prefilled[i], state.generated[i] = 10, 1
        q.running.add(i)
        # whole-sequence pools reserved 10 + 5 at admission; the others hold what was computed
        kv.take(int(state.rank[i]), i, 15 if isinstance(kv, WholeSequence) else 11)
    return cls(q, state, kv, config, Counters()), q, kv


def test_prefill_first_prefills_instead_of_decoding_on_the_rank_with_prompts():
    sched, q, _ = hand_built("prefill_first")
    plan = sched.next_step()
    assert plan.prefill == {0: [(0, 600), (1, 400)]}  # 1000-token chunk, request 1 split
    assert plan.decode.tolist() == [3]  # rank 0's decode waits for its prefill
    assert not plan.mixed
    assert list(q.queues[0]) == []


def test_decode_first_decodes_then_fills_the_token_budget_with_prompts():
    sched, _, kv = hand_built("decode_first", max_batched_tokens=1000)
    plan = sched.next_step()
    assert plan.decode.tolist() == [2, 3]  # every running request decodes
    assert plan.prefill == {0: [(0, 600), (1, 399)]}  # 1000 tokens less rank 0's one decode
    assert plan.mixed
    assert kv.used.tolist() == [11 + 1 + 999, 11 + 1]  # a slot per decode, the chunk's tokens


def test_split_runs_a_prefill_step_with_no_decodes():
    sched, _, _ = hand_built("split", max_batched_tokens=1000)
    plan = sched.next_step()
    assert plan.prefill == {0: [(0, 600), (1, 400)]}
    assert plan.decode.tolist() == []  # rank 1 idles: the decode queue waits its turn


def test_sglang_admits_what_the_reservation_leaves_room_for():
    # rank 0 holds 1200 tokens; request 2 holds 11 and still expects 4 outputs. Request 0
    # expects 600 + 5 and fits; request 1 would need 605 more with 589 free, so it waits
    sched, _, _ = hand_built("sglang", capacity=1200)
    plan = sched.next_step()
    assert plan.prefill == {0: [(0, 600)]}
    assert plan.decode.tolist() == [3]


def test_running_caps_stop_admission():
    # one running request on rank 0 and a cap of 2: only request 0 joins it
    sched, _, _ = hand_built("decode_first", max_batched_tokens=1000, max_running_per_rank=2)
    assert sched.next_step().prefill == {0: [(0, 600)]}
    sched, _, _ = hand_built("sglang", max_running_per_rank=1)
    plan = sched.next_step()
    assert plan.prefill == {} and plan.decode.tolist() == [2, 3]


def test_registry_names_every_policy_and_the_default_is_todays():
    assert set(COLOCATED) <= set(SCHEDULERS)
    assert ServingConfig(dp=1, kv_capacity_tokens=1).scheduler == "prefill_first"
    assert all(SCHEDULERS[n].summary for n in SCHEDULERS)
    with pytest.raises(EpsimError, match="scheduler must be one of"):
        ServingConfig(dp=1, kv_capacity_tokens=1, scheduler="fifo").validate()


# --------------------------------------------------------------------------------------------
# KV pressure: two requests of 4 + 4 tokens on a rank that holds 10
# --------------------------------------------------------------------------------------------

TWO = Requests(np.array([4, 4]), np.array([4, 4]), np.zeros(2))
STEPS = Affine(base=0.01, p_base=0.1)  # a decode step 10 ms, a prefill step 100 ms


def test_vllm_preempts_the_newest_request_and_recomputes_it():
    # t=0 both prefill (8 slots, 0.1 s); t=0.1 both decode (10 slots); t=0.11 a third slot
    # each does not fit: request 1 (newest) is preempted, its 5 slots freed, and no request is
    # admitted that step; t=0.12 its recompute (4 + 2 tokens) does not fit beside request 0's
    # 7; t=0.13 request 0 ends, request 1 recomputes (0.1 s) and that step gives its third
    # token; t=0.23 its last
    run = simulate_serving(TWO, ServingConfig(dp=1, kv_capacity_tokens=10,
                                              scheduler="decode_first"), STEPS)
    assert run.preemptions == 1
    assert run.first_token_s.tolist() == pytest.approx([0.1, 0.1])
    assert run.done_s.tolist() == pytest.approx([0.13, 0.24])
    assert sorted(run.itls_s.round(6)) == pytest.approx([0.01] * 5 + [0.12])
    assert [s.kind for s in run.steps] == ["prefill", "decode", "decode", "decode", "prefill",
                                          "decode"]


def test_whole_sequence_reservation_never_preempts_but_admits_later():
    # today's policy reserves 8 per request: the second waits until the first ends at 0.13
    run = simulate_serving(TWO, ServingConfig(dp=1, kv_capacity_tokens=10), STEPS)
    assert run.preemptions == 0
    assert run.first_token_s.tolist() == pytest.approx([0.1, 0.23])
    assert run.done_s.tolist() == pytest.approx([0.13, 0.26])


def test_sglang_reserves_like_today_until_outputs_pass_the_clip():
    # outputs within SGLang's 4096-token clip: the reservation is the whole sequence
    exact = simulate_serving(TWO, ServingConfig(dp=1, kv_capacity_tokens=10, scheduler="sglang"),
                             STEPS)
    assert exact.preemptions == 0 and exact.done_s.tolist() == pytest.approx([0.13, 0.26])
    # a clip of 1 output token (long outputs, scaled down): both are admitted, the decode at
    # 0.11 does not fit, and request 1 (tied on outputs and prompt) is retracted, then
    # recomputed after request 0 ends, as under vLLM
    run = simulate_serving(TWO, ServingConfig(dp=1, kv_capacity_tokens=10, scheduler="sglang",
                                              reserve_clip_tokens=1), STEPS)
    assert run.preemptions == 1
    assert run.done_s.tolist() == pytest.approx([0.13, 0.24])


def test_sglang_retracts_the_request_with_the_fewest_outputs():
    # request 0 starts first (it has more outputs when memory runs out): request 1 goes
    req = Requests(np.array([4, 4]), np.array([6, 6]), np.array([0.0, 0.105]))
    run = simulate_serving(req, ServingConfig(dp=1, kv_capacity_tokens=14, scheduler="sglang",
                                              reserve_clip_tokens=1), STEPS)
    assert run.preemptions == 1
    assert run.done_s[0] < run.done_s[1]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), dp=st.integers(1, 3), cap_seqs=st.integers(1, 4),
       conc=st.one_of(st.none(), st.integers(1, 12)), seed=st.integers(0, 10**4),
       name=st.sampled_from(COLOCATED), running=st.sampled_from([None, 2, 5]),
       budget=st.sampled_from([None, 64, 500]), clip=st.sampled_from([4096, 3]),
       mixed=st.booleans())
def test_every_policy_serves_every_request(n, dp, cap_seqs, conc, seed, name, running, budget,
                                           clip, mixed):
    rng = np.random.default_rng(seed)
    ins, outs = rng.integers(1, 300, n), rng.integers(1, 30, n)
    req = Requests(ins, outs, np.sort(rng.exponential(0.05, n)))
    cfg = ServingConfig(dp=dp, kv_capacity_tokens=int((ins + outs).max()) * cap_seqs,
                        chunked_prefill_size=128, scheduler=name, max_running_per_rank=running,
                        max_batched_tokens=budget, reserve_clip_tokens=clip, mixed_chunk=mixed)
    run = simulate_serving(req, cfg, Affine(base=0.01, per_seq=1e-3, per_ctx=1e-6, p_base=0.02,
                                            p_token=1e-4), concurrency=conc)
    assert np.all(run.first_token_s > run.send_s) and np.all(run.done_s >= run.first_token_s)
    # every output token but the first leaves exactly one gap, preempted or not
    assert len(run.itls_s) == int((outs - 1).sum()) and np.all(run.itls_s > 0)
    assert max(s.kv_usage for s in run.steps) <= 1.0 + 1e-12
    if running is not None:
        assert run.max_running_per_rank <= running
