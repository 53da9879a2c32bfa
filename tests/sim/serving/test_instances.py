"""Instances behind a router: the routers' choices, the instances' figures by hand, requests
conserved, one instance identical to none, the aggregate made of the instances, the flags."""

import numpy as np
import pytest
from serving_models import Affine, affine_factory

from epsim.cli import main
from epsim.model.errors import EpsimError
from epsim.sim.deployment import deployment_layout
from epsim.sim.scenario import StepCache, run_scenario
from epsim.sim.search.capacity import plan_capacity
from epsim.sim.search.slo import parse_slo
from epsim.sim.search.tune import SearchSpace
from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving.instances import aggregate, instance_metrics
from epsim.sim.serving.metrics import compute_metrics
from epsim.sim.serving.router import LeastLoaded, RoundRobin, make_router
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import Requests, WorkloadSpec

R1 = ["--model", "deepseek-r1", "--hardware", "mi300x"]
BENCH = ["--isl", "100", "--osl", "10", "--num-prompts", "8"]
ADDED = {"instance_nodes", "router", "num_instances", "prefill_instances", "decode_instances",
         "instances", "sim_wall_s"}


def reqs(isl, osl, times):
    n = len(times)
    return Requests(np.broadcast_to(isl, n).copy(), np.broadcast_to(osl, n).copy(),
                    np.asarray(times, dtype=float))


# --- the routers ------------------------------------------------------------------------


def test_round_robin_cycles_whatever_the_load():
    r = RoundRobin(3)
    picks = []
    for _ in range(4):
        picks.append(r.route())
    r.done(np.array([1, 1]))  # instance 1 finishes both of its requests
    picks += [r.route() for _ in range(3)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_takes_the_fewest_outstanding_ties_to_the_lowest_index():
    r = LeastLoaded(3)
    assert [r.route() for _ in range(4)] == [0, 1, 2, 0]  # ties spread in index order
    assert r.outstanding.tolist() == [2, 1, 1]
    r.done(np.array([2]))  # instance 2 finished one: [2, 1, 0]
    assert r.route() == 2
    r.done(np.array([0, 0]))  # [0, 1, 1]
    assert [r.route() for _ in range(3)] == [0, 0, 1]  # [1, 1, 1] after the first, then 0
    assert r.outstanding.tolist() == [2, 2, 1]


def test_a_dp_rank_dispatcher_reads_its_owner_s_load():
    # within an instance the same policies pick a dp rank by what each rank holds now
    held = [3, 1, 1, 0]
    least = make_router("least_loaded", 4, lambda r: held[r])
    assert least.route() == 3
    held[3] = 5
    assert [least.route(), least.route()] == [1, 1]  # ties to the lowest rank
    robin = make_router("round_robin", 3, lambda r: held[r])
    assert [robin.route() for _ in range(4)] == [0, 1, 2, 0]  # whatever the load
    assert least.outstanding.tolist() == [0, 0, 0, 0]  # the owner counts, not the router


def test_unknown_router_is_one_line():
    with pytest.raises(EpsimError, match="router must be one of round_robin, least_loaded"):
        make_router("random", 2)


# --- the serving loop with instances, by hand ---------------------------------------------


def test_two_colocated_instances_by_hand():
    # 4 requests at t=0, round robin: 0, 1, 0, 1; each instance (dp 1) prefills its two in one
    # step (0.1 s) and decodes 4 steps of 10 ms: the same timeline as one instance of 4
    cfg = ServingConfig(dp=1, kv_capacity_tokens=10**6, instances=2)
    run = simulate_serving(reqs(100, 5, [0, 0, 0, 0]), cfg, Affine(base=0.01, p_base=0.1))
    assert run.instance.tolist() == [0, 1, 0, 1]
    assert run.done_s.tolist() == pytest.approx([0.14] * 4)
    m = compute_metrics(run)
    inst = instance_metrics(run, m["duration"], (50.0, 90.0), ("ttft", "itl"))
    assert [(i["role"], i["index"], i["requests"]) for i in inst] == [
        ("colocated", 0, 2), ("colocated", 1, 2)]
    for i in inst:
        assert i["output_throughput"] == pytest.approx(10 / 0.14)
        assert i["decode_throughput"] == pytest.approx(8 / 0.04)  # 8 tokens in 4 x 10 ms
        assert i["num_steps"] == 5 and i["max_running_per_rank"] == 2
        assert i["median_ttft_ms"] == pytest.approx(100.0)
        assert i["median_itl_ms"] == pytest.approx(10.0)
    # the pooled ratio is one instance's rate; the instances decode in parallel
    assert m["decode_throughput"] == pytest.approx(200.0)
    assert aggregate(m, inst)["decode_throughput"] == pytest.approx(400.0)


def test_least_loaded_sends_to_the_instance_that_finished():
    # r0 is long (done at 1.09 s), r1 short (prefill 0.1 + one decode: done at 0.11 s); r2
    # arrives at 0.5 s: round robin sends it to instance 0, least loaded to idle instance 1
    lens = np.array([100, 2, 5])
    requests = Requests(np.full(3, 100), lens, np.array([0.0, 0.0, 0.5]))
    for router, expect in (("round_robin", [0, 1, 0]), ("least_loaded", [0, 1, 1])):
        cfg = ServingConfig(dp=1, kv_capacity_tokens=10**6, instances=2, router=router)
        run = simulate_serving(requests, cfg, Affine(base=0.01, p_base=0.1))
        assert run.instance.tolist() == expect
        assert run.done_s[1] == pytest.approx(0.11)
        # on its own instance r2 prefills at once: 0.5 + 0.1 + 4 x 0.01
        if router == "least_loaded":
            assert run.done_s[2] == pytest.approx(0.64)


def test_disaggregated_instances_conserve_requests():
    cfg = ServingConfig(dp=2, kv_capacity_tokens=10**6, prefill_dp=1,
                        prefill_kv_capacity_tokens=10**6, kv_transfer_s_per_token=1e-5,
                        instances=3, prefill_instances=2, router="least_loaded")
    times = np.linspace(0.0, 0.5, 30)
    run = simulate_serving(reqs(200, 7, times), cfg, Affine(base=0.01), Affine(p_base=0.05))
    m = compute_metrics(run)
    inst = instance_metrics(run, m["duration"], (50.0,), ("ttft",))
    assert [(i["role"], i["index"]) for i in inst] == [
        ("prefill", 0), ("prefill", 1), ("decode", 0), ("decode", 1), ("decode", 2)]
    for role in ("prefill", "decode"):
        mine = [i for i in inst if i["role"] == role]
        assert sum(i["requests"] for i in mine) == 30
        assert sum(i["total_output_tokens"] for i in mine) == 30 * 7
        assert sum(i["request_throughput"] for i in mine) == pytest.approx(
            m["request_throughput"], rel=1e-12)
    assert sorted(set(run.prefill_instance.tolist())) == [0, 1]
    assert sorted(set(run.instance.tolist())) == [0, 1, 2]
    assert sum(i["num_steps"] for i in inst) == m["num_steps"]
    # every ITL was emitted by a decode instance
    assert sum(len(run.itls_s[run.itl_instance == k]) for k in range(3)) == len(run.itls_s)


# --- scenarios ----------------------------------------------------------------------------


def scenario(**kw):
    return Scenario.of(model="deepseek-r1", hardware="mi300x", dp=8, ep=8,
                    workload=WorkloadSpec(num_prompts=48, isl=500, osl=20, concurrency=48,
                                          request_rate=200.0), **kw)


@pytest.mark.parametrize("kw", [{}, {"disagg": (1, 1)}, {"engine": "vllm"}])
def test_one_instance_is_todays_result_bit_for_bit(kw):
    cache = StepCache(affine_factory())
    today = run_scenario(scenario(**kw), cache)
    one = run_scenario(scenario(instance_nodes=1, **kw), cache)
    assert {k for k in one if k not in today} == ADDED - {"sim_wall_s"}
    for k in today:
        if k != "sim_wall_s":
            assert one[k] == today[k], k
    assert len(one["instances"]) == (2 if kw.get("disagg") else 1)


def test_two_to_three_instances_aggregate_their_figures():
    r = run_scenario(scenario(disagg=(2, 3), instance_nodes=1, router="least_loaded"),
                     StepCache(affine_factory()))
    assert (r["nodes"], r["dp"], r["ep"], r["prefill_dp"], r["prefill_ep"]) == (5, 8, 8, 8, 8)
    assert (r["num_instances"], r["prefill_instances"], r["decode_instances"]) == (5, 2, 3)
    inst = r["instances"]
    assert [(i["role"], i["index"], i["nodes"], i["plan"]) for i in inst] == [
        (role, k, 1, {"dp": 8, "tp": 1, "ep": 8})
        for role, n in (("prefill", 2), ("decode", 3)) for k in range(n)]
    decode = [i for i in inst if i["role"] == "decode"]
    assert sum(i["requests"] for i in decode) == 48
    for key in ("output_throughput", "total_token_throughput", "request_throughput",
                "decode_throughput"):
        assert sum(i[key] for i in decode) == pytest.approx(r[key], rel=1e-12), key
    assert sum(i["num_steps"] for i in inst) == r["num_steps"]
    assert max(i["max_running_per_rank"] for i in inst) == r["max_running_per_rank"]


def test_prefill_side_has_its_own_plan():
    r = run_scenario(scenario(disagg=(1, 1), prefill_dp=4, prefill_tp=2, instance_nodes=1),
                     StepCache(affine_factory()))
    assert (r["prefill_dp"], r["prefill_tp"], r["prefill_ep"]) == (4, 2, 8)
    assert r["instances"][0]["plan"] == {"dp": 4, "tp": 2, "ep": 8}
    assert r["instances"][1]["plan"] == {"dp": 8, "tp": 1, "ep": 8}


def test_layout_refuses_what_does_not_divide():
    assert deployment_layout(scenario(disagg=(2, 4), instance_nodes=2).deployment).decode_instances == 2
    with pytest.raises(EpsimError, match="--instance-nodes 2 does not divide the 3 decode"):
        deployment_layout(scenario(disagg=(2, 3), instance_nodes=2).deployment)
    with pytest.raises(EpsimError, match="--instance-nodes 2 does not divide --nodes 3"):
        deployment_layout(scenario(nodes=3, instance_nodes=2).deployment)
    with pytest.raises(EpsimError, match="need --disagg"):
        deployment_layout(scenario(prefill_ep=8).deployment)


def test_plan_counts_instances():
    base = scenario(instance_nodes=1).with_(dp=None, ep=None)
    plans = plan_capacity(base, parse_slo("median_itl_ms<=50"), 50_000.0,
                          SearchSpace(concurrency=(16,), dbo=(True,)), hardware=["mi300x"],
                          unit_layouts=[(1, 2)], cache=StepCache(affine_factory()))
    (p,) = plans
    assert p.instance_nodes == 1
    assert (p.prefill_instances, p.decode_instances) == (p.units, 2 * p.units)
    assert p.instances == 3 * p.units and p.nodes == 3 * p.units


# --- the command line ---------------------------------------------------------------------


def refused(capsys, *argv, match):
    try:
        status = main(list(argv))
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and match in err, err


@pytest.mark.parametrize("extra, match", [
    (["--disagg", "2:3", "--instance-nodes", "2"], "does not divide the 3 decode nodes"),
    (["--nodes", "3", "--instance-nodes", "2"], "does not divide --nodes 3"),
    (["--prefill-tp", "2"], "need --disagg"),
    (["--instance-nodes", "0"], "--instance-nodes"),
    (["--router", "random"], "--router"),
    (["--disagg", "1:1", "--prefill-ep", "3"], "ep 3"),
])
def test_flags_are_validated(capsys, extra, match):
    refused(capsys, "predict", *R1, *BENCH, *extra, match=match)
