"""simulate_step end to end: the acceptance scenario, fast vs exact, ablation directions, traces."""

import json

import numpy as np
import pytest

from epsim.model import Batch, EpsimError, load_model, make_plan
from epsim.model.loads import read_loads
from epsim.model.placement import contiguous_placement
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.simulate import simulate_step

R1 = load_model("deepseek-r1")
MI = load_profile("mi300x")
ACCEPT = Batch.decode(512, 2100)


def step(batch=ACCEPT, model=R1, profile=MI, nodes=1, **kw):
    plan_keys = ("microbatches", "graph_mode", "kv_dtype", "dp", "tp", "ep")
    plan_kw = {k: kw.pop(k) for k in list(kw) if k in plan_keys}
    plan_kw.setdefault("dp", 8 * nodes)
    if "tp" not in plan_kw:
        plan_kw.setdefault("ep", 8 * nodes)
    plan = make_plan(model, nodes=nodes, **plan_kw)
    return simulate_step(model, plan, batch, profile, **kw)


@pytest.fixture(scope="module")
def base():
    return step()


def test_breakdown_accounts_for_the_step(base):
    assert 20 < base.step_ms < 500
    assert sum(base.breakdown_ms.values()) == pytest.approx(base.step_ms, rel=1e-9)
    assert set(base.breakdown_ms) >= {"attention", "moe_experts", "dispatch", "combine", "dense",
                                      "other", "launch"}
    exposed = sum(base.breakdown_ms[c] for c in ("dispatch", "combine", "tp_comm"))
    assert base.exposed_comm_ms == pytest.approx(exposed)
    # the comm in flight is either hidden behind compute or exposed
    assert base.overlapped_comm_ms == pytest.approx(sum(base.comm_busy_ms.values()) - exposed)
    assert 1.0 <= base.expert_imbalance < 1.1
    assert max(base.rank_ms) == pytest.approx(base.step_ms)


def test_fast_and_exact_agree_within_one_percent(base):
    exact = step(mode="exact")
    assert exact.step_ms == pytest.approx(base.step_ms, rel=0.01)
    for k, v in base.breakdown_ms.items():
        assert exact.breakdown_ms[k] == pytest.approx(v, rel=0.01, abs=0.05)


def test_same_seed_same_result(base):
    again = step(seed=0)
    assert again.step_ms == base.step_ms and again.rank_ms == base.rank_ms
    other = step(seed=1)
    assert other.rank_ms != base.rank_ms


def test_ablations_move_the_way_physics_says(base):
    # eager launches with a host sync per dispatch: slower
    assert step(graph_mode=False).step_ms > base.step_ms
    # a BF16 KV cache reads twice the bytes and runs BF16 attention math: slower
    assert step(kv_dtype="bf16").step_ms > base.step_ms
    # contiguous placement on the real loads: the busiest GPU has ~1.7-2.1x the expert work
    real = read_loads("decode_in2000out100")
    balanced = step(loads=real)
    contiguous = step(loads=real, eplb=False)
    assert balanced.expert_imbalance < 1.1
    assert 1.7 <= contiguous.expert_imbalance <= 2.1
    assert contiguous.step_ms > balanced.step_ms
    # an explicit placement is used as given
    given = step(loads=real, placement=contiguous_placement(61, 256, 8))
    assert given.step_ms == contiguous.step_ms
    # without DBO the dispatch/combine is exposed; with it, hidden
    no_dbo = step(microbatches=1)
    assert no_dbo.exposed_comm_ms > 5 * max(base.exposed_comm_ms, 0.1)


def test_dbo_hurts_at_small_batch_and_helps_when_comm_dominates():
    small = Batch.decode(8, 2100)
    assert step(small, microbatches=1).step_ms < step(small).step_ms
    # two nodes: EP16 over the NIC, the all-to-all dominates and DBO hides it
    assert step(nodes=2).step_ms < step(nodes=2, microbatches=1).step_ms


def test_trace_shows_ranks_streams_microbatches_and_overlap():
    res = step(trace=True, mode="exact")
    ev = res.events
    assert {e.rank for e in ev} == set(range(8))
    assert {e.stream for e in ev} == {"compute", "comm"}
    assert {e.microbatch for e in ev} == {0, 1}
    assert {e.op_id for e in ev if e.rank == 0} >= {"L3.moe.dispatch.mb1", "L60.moe.combine.mb0"}
    # some communication overlaps compute on the same rank
    comm = [e for e in ev if e.rank == 0 and e.stream == "comm"]
    comp = [e for e in ev if e.rank == 0 and e.stream == "compute"]
    starts = np.array([e.start_us for e in comp])
    ends = np.array([e.end_us for e in comp])
    assert any(np.any((starts < c.end_us) & (ends > c.start_us)) for c in comm)
    # the fast mode traces the same ops at the same times
    fast = step(trace=True)
    assert len(fast.events) == len(ev)
    assert fast.step_ms == pytest.approx(res.step_ms, rel=1e-9)


@pytest.mark.parametrize("name, kw", [
    ("tp-moe", dict(tp=8, dp=1, ep=1)),
    ("tp2-ep", dict(dp=4, tp=2, ep=8)),
    ("eager-no-dbo", dict(graph_mode=False, microbatches=1)),
])
def test_other_plans_run_and_agree(name, kw):
    batch = Batch.decode(64, 1024)
    fast = step(batch, **kw)
    exact = step(batch, mode="exact", **kw)
    assert exact.step_ms == pytest.approx(fast.step_ms, rel=0.01)
    assert sum(fast.breakdown_ms.values()) == pytest.approx(fast.step_ms, rel=1e-9)
    if kw.get("tp", 1) > 1:
        assert fast.comm_busy_ms["tp_comm"] > 0


def test_prefill_and_other_models():
    pre = step(Batch.prefill(2, 2048), microbatches=1)
    dec = step(Batch.decode(2, 2048), microbatches=1)
    assert pre.step_ms > dec.step_ms
    gpt = load_model("gpt-oss-120b")
    r = step(Batch.decode(32, 1000), model=gpt, profile=load_profile("h100"))
    assert r.step_ms > 0
    tiny = load_model("tiny-deepseek")
    r = simulate_step(tiny, make_plan(tiny, dp=2, ep=2, gpus_per_node=2), Batch.decode(4, 16),
                      MI, synthetic="uniform")
    assert r.step_ms > 0


def test_bad_inputs_are_one_line_errors():
    plan = make_plan(R1, dp=8, ep=8)
    with pytest.raises(EpsimError, match="mode must be one of"):
        simulate_step(R1, plan, ACCEPT, MI, mode="slow")
    with pytest.raises(EpsimError, match="do not match"):
        simulate_step(R1, plan, ACCEPT, MI, loads=np.ones((61, 128)))
    with pytest.raises(EpsimError, match="ep 8"):
        simulate_step(R1, plan, ACCEPT, MI, placement=contiguous_placement(61, 256, 4))
    with pytest.raises(EpsimError, match="seed must be"):
        simulate_step(R1, plan, ACCEPT, MI, seed=-1)
    with pytest.raises(EpsimError, match="synthetic loads"):
        simulate_step(R1, plan, ACCEPT, MI, synthetic="zipf")
    bare = json.loads(json.dumps(MI.raw))
    bare.pop("efficiency")
    with pytest.raises(EpsimError, match="no 'efficiency' tables"):
        simulate_step(R1, plan, ACCEPT, profile_from_dict(bare))


def test_repeated_calls_of_one_owner_reuse_the_compiled_graph():
    from epsim.sim.step import StepMemo
    from epsim.sim.step.compile import compile_step

    plan = make_plan(R1, dp=8, ep=8)
    batch = Batch.decode(77, 300)
    memo = StepMemo()
    simulate_step(R1, plan, batch, MI, memo=memo)
    first = compile_step(R1, plan, batch, MI, memo)
    simulate_step(R1, plan, batch, MI, seed=5, memo=memo)
    assert compile_step(R1, plan, batch, MI, memo) is first
    # another owner's memo shares nothing
    assert compile_step(R1, plan, batch, MI, StepMemo()) is not first


def test_memo_caches_keep_at_most_their_bound():
    from collections import OrderedDict

    from epsim.sim.step import StepMemo
    from epsim.sim.step import memo as step_memo
    from epsim.sim.step import simulate as sim_step

    memo = StepMemo()
    loads = sim_step._synthetic_loads(R1, "uniform", memo)
    assert not loads.flags.writeable  # shared by every caller of this memo
    assert sim_step._synthetic_loads(R1, "uniform", memo) is loads
    cache = OrderedDict()
    for i in range(step_memo.CACHE_SIZE + 10):
        step_memo.remember(cache, (i,), i)
    assert len(cache) == step_memo.CACHE_SIZE
    assert next(iter(cache)) == (10,)  # the oldest went first
