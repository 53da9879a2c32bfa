"""How long issuing an exchange holds an eager host (``a2a_host_block_by_group_s``): the fit
from the all-to-all table, the profile key, the program the simulator builds from it, and the
validation report judged on the median of its passes; and the other CPU-run terms fitted beside
it (stragglers, the in-step exchange latency, the comm/compute slowdown and the slowest rank's
lateness per world size)."""

import copy
import json

import numpy as np
import pandas as pd
import pytest

from epsim.calibrate.comm_fit import fit_host_block
from epsim.calibrate.fit import fit_rank_skew
from epsim.calibrate.micro import rank_skews
from epsim.calibrate.validate import Case, compare
from epsim.model.config import load_model
from epsim.model.errors import EpsimError
from epsim.model.graph import build_step_graph
from epsim.model.opgraph import Batch
from epsim.model.plan import make_plan
from epsim.sim.hardware.profile import load_profile, profile_from_dict
from epsim.sim.step.holds import host_holds
from epsim.sim.step.simulate import simulate_step


def _with(key: str, value) -> dict:
    raw = json.loads(json.dumps(load_profile("mi300x").raw))
    raw["efficiency"][key] = value
    raw["sources"][f"efficiency.{key}"] = "test"
    return raw


def test_fit_keeps_the_fixed_part_of_the_call_time():
    # host_s = 3 ms + 2e-8 s per link byte (dispatch, world 4), 0.5 ms flat (combine, world 2)
    rows = [{"kind": "dispatch", "world": 4, "link_bytes": b, "host_s": 3e-3 + 2e-8 * b}
            for b in (100.0, 2e3, 1e5)]
    rows += [{"kind": "combine", "world": 2, "link_bytes": b, "host_s": 5e-4}
             for b in (100.0, 1e5)]
    held = fit_host_block(pd.DataFrame(rows))
    assert held["dispatch"][4] == pytest.approx(3e-3, rel=1e-6)
    assert held["combine"][2] == pytest.approx(5e-4, rel=1e-6)
    # tables written before the column existed fit nothing
    assert fit_host_block(pd.DataFrame(rows).drop(columns=["host_s"])) == {}


def test_profile_key_interpolates_and_is_checked():
    e = profile_from_dict(_with("a2a_host_block_by_group_s",
                                {"dispatch": {"2": 4e-3, "4": 10e-3}})).require_efficiency()
    assert e.host_block("dispatch", 3) == pytest.approx(7e-3)
    assert e.host_block("dispatch", 8) == pytest.approx(10e-3 + 3e-3 * 4)  # the last slope
    assert e.host_block("combine", 4) is None  # not measured
    assert load_profile("mi300x").require_efficiency().host_block("dispatch", 8) is None
    with pytest.raises(EpsimError, match="a2a_host_block_by_group_s must be"):
        profile_from_dict(_with("a2a_host_block_by_group_s", {"count": {"2": 1e-3}}))


def _ops(world: int):
    model = load_model("tiny-deepseek")
    plan = make_plan(model, nodes=1, gpus_per_node=world, dp=world, tp=1, ep=world)
    graph = build_step_graph(model, plan, Batch.decode(4, 64))
    ops = [graph.ops[o] for o in graph.schedule.order()]
    groups = np.array([world if op.is_collective else 0 for op in ops])
    return ops, groups


def test_measured_host_block_holds_the_host_on_both_exchanges():
    ops, groups = _ops(4)
    raw = _with("a2a_host_block_by_group_s", {"dispatch": {"2": 4e-3, "4": 10e-3},
                                              "combine": {"2": 5e-4, "4": 3e-3}})
    sync, release = host_holds(ops, groups, profile_from_dict(raw), captured=False)
    kinds = [op.kind for op in ops]
    for i, k in enumerate(kinds):
        want = {"dispatch": 10e-3, "combine": 3e-3}.get(k, 0.0)
        assert release[i] == pytest.approx(want) and sync[i] == (k in ("dispatch", "combine"))
    assert kinds.count("dispatch") == kinds.count("combine") > 0
    # inside a captured graph the host holds nothing
    sync, release = host_holds(ops, groups, profile_from_dict(raw), captured=True)
    assert not sync.any() and not release.any()


def test_without_the_key_a_dispatch_holds_the_host_for_its_latency_and_a_combine_not():
    ops, groups = _ops(4)
    prof = load_profile("mi300x")
    sync, release = host_holds(ops, groups, prof, captured=False)
    lat = prof.require_efficiency().a2a_latency("dispatch", 4)
    for i, op in enumerate(ops):
        assert sync[i] == (op.kind == "dispatch")
        assert release[i] == pytest.approx(lat if op.kind == "dispatch" else 0.0)


def test_a_case_is_judged_on_the_median_of_its_passes():
    # three passes of three steps: medians 10, 30 (a busy pass), 12 -> the case measures 12,
    # where the median over all nine steps would be 12 too but a pass of 30s would move it
    steps = [9.0, 10.0, 11.0, 29.0, 30.0, 31.0, 11.0, 12.0, 13.0]
    measured = [{"step_ms": steps, "pass_ms": [10.0, 30.0, 12.0], "kind_ms": {}},
                {"step_ms": [10.0, 10.0, 40.0, 40.0], "pass_ms": [10.0, 40.0, 10.0],
                 "kind_ms": {}}]
    predicted = [{"step_ms": [13.2], "kind_ms": {}}, {"step_ms": [11.0], "kind_ms": {}}]
    rep = compare([Case("m", 2, 8, 64), Case("m", 4, 8, 64)], measured, predicted)
    a, b = rep["cases"]
    assert a["measured_ms"] == 12.0 and a["error_pct"] == pytest.approx(10.0)
    assert a["pass_spread_pct"] == pytest.approx((30 - 10) / 12 * 100)
    assert a["pass_error_pct"] == pytest.approx([32.0, -56.0, 10.0])
    # the pooled steps' median would be 25 (two slow steps of four); the passes say 10
    assert b["measured_ms"] == 10.0 and b["pass_spread_pct"] == pytest.approx(300.0)
    assert rep["median_pass_spread_pct"] == pytest.approx((300 + 500 / 3) / 2)
    assert rep["max_pass_spread_pct"] == pytest.approx(300.0)


def test_straggler_is_a_fixed_part_plus_a_share_of_the_compute_between_exchanges():
    from epsim.calibrate.comm_fit import fit_straggler

    # world 4: straggler = 1 ms + 0.4 x segment; world 2: 0.2 ms flat
    ranks = pd.DataFrame(
        [{"kind": "dispatch", "world": 4, "segment_s": g, "straggler_s": 1e-3 + 0.4 * g}
         for g in (2e-3, 10e-3)]
        + [{"kind": "combine", "world": 4, "segment_s": 1e-3, "straggler_s": 1.4e-3}]
        + [{"kind": "combine", "world": 2, "segment_s": g, "straggler_s": 2e-4}
           for g in (1e-3, 8e-3)]
        + [{"kind": "norm", "world": 4, "segment_s": np.nan, "straggler_s": np.nan}])
    fixed, fraction = fit_straggler(ranks)
    assert fixed[4] == pytest.approx(1e-3, rel=1e-6)
    assert fraction[4] == pytest.approx(0.4, rel=1e-6)
    assert fixed[2] == pytest.approx(2e-4, rel=1e-6) and fraction[2] == pytest.approx(0.0)
    assert fit_straggler(ranks.drop(columns=["segment_s"])) == ({}, {})


def test_exchange_latency_is_the_last_arrivals_plus_the_fixed_straggler():
    from epsim.calibrate.comm_fit import fit_exchange

    # the last rank to arrive waits 2 ms (dispatch, w2) / 1 ms (combine, w2) + bytes / 1e8;
    # the slowest rank's time holds 5 ms more (the benchmark's own straggler)
    a2a = pd.DataFrame([{"kind": k, "world": 2, "link_bytes": b,
                         "last_s": lat + b / 1e8, "time_s": lat + 5e-3 + b / 1e8}
                        for k, lat in (("dispatch", 2e-3), ("combine", 1e-3))
                        for b in (1e3, 1e5, 1e6)])
    ranks = pd.DataFrame([{"kind": "dispatch", "world": 2, "segment_s": g,
                           "straggler_s": 5e-4 + 0.1 * g} for g in (1e-3, 5e-3)])
    fit, parts = fit_exchange(a2a, ranks, "last-plus-straggler")
    assert fit.latency_s["dispatch"][2] == pytest.approx(2.5e-3, rel=1e-6)
    assert fit.latency_s["combine"][2] == pytest.approx(1.5e-3, rel=1e-6)
    assert fit.bandwidth == pytest.approx(1e8, rel=1e-6)
    assert parts["latency_s"]["dispatch"][2] == pytest.approx(2e-3, rel=1e-6)
    assert parts["straggler_fraction"][2] == pytest.approx(0.1, rel=1e-6)
    # without the ranks' stragglers: the slowest rank's time, as before
    old, none = fit_exchange(a2a, None, "last-plus-straggler")
    assert old.latency_s["dispatch"][2] == pytest.approx(7e-3, rel=1e-6) and none == {}
    # the slowest rank's time, whatever the tables hold
    slowest, nothing = fit_exchange(a2a, ranks, "slowest")
    assert slowest.latency_s["dispatch"][2] == pytest.approx(7e-3, rel=1e-6)
    assert slowest.latency_s["combine"][2] == pytest.approx(6e-3, rel=1e-6) and nothing == {}
    with pytest.raises(EpsimError, match="exchange fit"):
        fit_exchange(a2a, ranks, "fastest")


def test_in_step_exchange_latency_is_the_ranks_sweeps_median_exchange_time():
    from epsim.calibrate.comm_fit import fit_exchange
    from epsim.calibrate.exchange_fits import DEFAULT_EXCHANGE_FIT

    a2a = pd.DataFrame([{"kind": k, "world": w, "link_bytes": b, "time_s": lat * w + b / 1e8}
                        for k, lat in (("dispatch", 6e-3), ("combine", 3e-3))
                        for w in (2, 4) for b in (1e3, 1e5, 1e6)])
    # decode-step exchanges of the ranks sweep: dispatch at both world sizes, combine at 2 only,
    # and a world-1 row (no peers) that must be ignored
    ranks = pd.DataFrame([{"kind": "dispatch", "world": 2, "time_s": t} for t in (4e-3, 5e-3, 9e-3)]
                         + [{"kind": "dispatch", "world": 4, "time_s": t} for t in (1e-2, 1.2e-2)]
                         + [{"kind": "combine", "world": 2, "time_s": 1.5e-3},
                            {"kind": "dispatch", "world": 1, "time_s": 1.0}])
    fit, parts = fit_exchange(a2a, ranks, "in-step")
    assert DEFAULT_EXCHANGE_FIT == "in-step" and parts == {}
    assert fit.latency_s["dispatch"] == {2: pytest.approx(5e-3), 4: pytest.approx(1.1e-2)}
    # combine at 4 ranks: no decode-step exchange measured, the benchmark's own latency
    assert fit.latency_s["combine"][2] == pytest.approx(1.5e-3)
    assert fit.latency_s["combine"][4] == pytest.approx(1.2e-2, rel=1e-6)
    assert fit.bandwidth == pytest.approx(1e8, rel=1e-6)  # the benchmark's
    bench, _ = fit_exchange(a2a, None, "in-step")  # no ranks sweep: the benchmark alone
    assert bench.latency_s["dispatch"][2] == pytest.approx(1.2e-2, rel=1e-6)


def test_comm_slowdown_is_fitted_and_looked_up_per_world_size():
    from epsim.calibrate.fit import fit_comm_slowdown_by_world

    cont = pd.DataFrame([{"world": 2, "probe_s": 0.01, "probe_under_comm_s": 0.0125},
                         {"world": 4, "probe_s": 0.01, "probe_under_comm_s": 0.04}])
    assert fit_comm_slowdown_by_world(cont) == {2: pytest.approx(0.2), 4: pytest.approx(0.75)}
    obj = copy.deepcopy(dict(load_profile("mi300x").raw))
    eff = profile_from_dict(obj, "x").require_efficiency()
    assert eff.comm_slowdown(8) == eff.comm_compute_slowdown  # no table: the scalar
    obj["efficiency"]["comm_compute_slowdown_by_group"] = {"2": 0.2, "4": 0.75}
    obj["sources"]["efficiency.comm_compute_slowdown_by_group"] = "a test"
    eff = profile_from_dict(obj, "x").require_efficiency()
    assert [eff.comm_slowdown(w) for w in (1, 2, 3, 4, 8)] == pytest.approx(
        [0.2, 0.2, 0.475, 0.75, 0.75])
    obj["efficiency"]["comm_compute_slowdown_by_group"] = {"2": 1.0}
    with pytest.raises(EpsimError, match="below 1"):
        profile_from_dict(obj, "x")


def test_a_steps_comm_slowdown_is_its_ranks_per_nodes_entry():
    from epsim.sim.step.simulate import simulate_step

    model = load_model("deepseek-r1")
    plan = make_plan(model, dp=8, ep=8)  # 8 ranks on the node, DBO: exchanges overlap compute
    batch = Batch.decode(256, 2000)

    def step_ms(raw: dict) -> float:
        return simulate_step(model, plan, batch, profile_from_dict(raw), seed=1).step_ms

    base = json.loads(json.dumps(load_profile("mi300x").raw))
    scalar = base["efficiency"]["comm_compute_slowdown"]
    same = _with("comm_compute_slowdown_by_group", {"2": 0.9, "8": scalar, "16": 0.9})
    assert step_ms(same) == step_ms(base)
    heavier = _with("comm_compute_slowdown_by_group", {"8": 0.6})
    as_scalar = _with("comm_compute_slowdown", 0.6)
    assert step_ms(heavier) == step_ms(as_scalar) > step_ms(base)


def test_exchange_records_sum_the_compute_since_the_previous_exchange():
    from epsim.calibrate.micro import exchange_records
    from epsim.model.trace import TraceEvent

    def ev(op, kind, stream, start, dur, rank=0, step=1):
        return TraceEvent(op, kind, rank, stream, start, dur, args={"step": step})

    events = [ev("a", "norm", "compute", 0, 100), ev("b", "router", "compute", 100, 300),
              ev("d", "dispatch", "comm", 400, 2000), ev("e", "grouped_gemm", "compute", 2400, 500),
              ev("c", "combine", "comm", 2900, 1000), ev("w", "norm", "compute", 0, 9, step=0)]
    assert exchange_records(events) == [("d", 1, pytest.approx(2e-3), pytest.approx(4e-4)),
                                        ("c", 1, pytest.approx(1e-3), pytest.approx(5e-4))]


def test_stragglers_grow_with_the_compute_issued_since_the_previous_exchange():
    from epsim.sim.step.holds import stragglers

    ops, groups = _ops(4)
    raw = _with("exchange_straggler_fraction", {"2": 0.1, "4": 0.5})
    prof = profile_from_dict(raw)
    assert prof.require_efficiency().straggler_fraction(3) == pytest.approx(0.3)
    assert prof.require_efficiency().straggler_fraction(1) == 0.0
    # a world size whose stragglers did not grow with the compute fits 0, which loads
    zero = profile_from_dict(_with("exchange_straggler_fraction", {"2": 0.0, "4": 0.2}))
    assert zero.require_efficiency().straggler_fraction(2) == 0.0
    with pytest.raises(EpsimError, match="must be a non-negative number"):
        profile_from_dict(_with("exchange_straggler_fraction", {"2": -0.1}))
    work = np.array([0.0 if op.is_collective else 1e-3 for op in ops])
    plan = make_plan(load_model("tiny-deepseek"), nodes=1, gpus_per_node=4, dp=4, tp=1, ep=4)
    late = stragglers(ops, work, prof, plan)
    since = 0
    for i, op in enumerate(ops):
        if op.kind in ("dispatch", "combine"):
            assert late[i] == pytest.approx(0.5 * since * 1e-3)  # half a ms per op since
            since = 0
        else:
            assert late[i] == 0.0
            since += not op.is_collective
    assert late.max() > 0
    # the dispatch's host hold grows by its straggler; GPU profiles have none
    sync, release = host_holds(ops, groups, prof, captured=False, late=late)
    lat = prof.require_efficiency().a2a_latency("dispatch", 4)
    i = next(i for i, op in enumerate(ops) if op.kind == "dispatch")
    assert release[i] == pytest.approx(lat + late[i])
    assert stragglers(ops, work, load_profile("mi300x"), plan) is None


@pytest.mark.parametrize("ratio, world, want", [
    (1.5, 2, 1.5),    # one more busy thread on 2 cores: 3 threads where the 2 ranks were
    (1.5, 4, 1.25),   # 5 threads where 4 ranks were
    (1.0, 4, 1.0),    # the machine as at calibration
    (0.75, 2, 0.75),  # half a thread less than at calibration
])
def test_load_factor_is_processor_sharing(ratio, world, want):
    from epsim.calibrate.probe import load_factor

    assert load_factor(ratio, world, cores=2) == pytest.approx(want)


def test_predictions_follow_the_machine_probe():
    from epsim.calibrate.validate import adjust_for_load

    cases = [Case("m", 2, 8, 64), Case("m", 4, 8, 64)]
    predicted = [{"step_ms": [10.0, 12.0], "kind_ms": {"gemm": [1.0, 2.0]}},
                 {"step_ms": [40.0], "kind_ms": {}}]
    # the probe ran 1.5x as long as at calibration on 2 cores: world 2 x1.5, world 4 x1.25
    a, b = adjust_for_load(cases, predicted, 1.5, cores=2)
    assert a["step_ms"] == pytest.approx([15.0, 18.0]) and a["load_factor"] == 1.5
    assert a["kind_ms"]["gemm"] == pytest.approx([1.5, 3.0])
    assert b["step_ms"] == pytest.approx([50.0]) and b["unadjusted_step_ms"] == [40.0]
    measured = [{"step_ms": [15.0], "kind_ms": {}}, {"step_ms": [50.0], "kind_ms": {}}]
    rep = compare(cases, measured, [a, b])
    assert [c["error_pct"] for c in rep["cases"]] == pytest.approx([10.0, 0.0])
    assert rep["cases"][0]["predicted_unadjusted_ms"] == pytest.approx(11.0)
    assert rep["cases"][1]["load_factor"] == pytest.approx(1.25)


def test_core_probe_times_its_loop():
    from epsim.calibrate.probe import core_probe, probe_record

    seconds = core_probe(processes=2, loop=2000, repeats=2)
    assert 0 < seconds < 5
    rec = probe_record([3.0, 1.0, 2.0])
    assert rec["seconds"] == 2.0 and rec["samples"] == [3.0, 1.0, 2.0]


def test_exchange_times_per_repeat_over_the_ranks():
    from epsim.calibrate.comm_bench import _per_repeat

    # one round, two ranks, two repeats at 16 tokens (and a row at 8 tokens to be ignored)
    ranks = [{"a2a": [{"tokens": 16, "rep": 2, "t_s": 5.0}, {"tokens": 16, "rep": 3, "t_s": 1.0},
                      {"tokens": 8, "rep": 2, "t_s": 99.0}]},
             {"a2a": [{"tokens": 16, "rep": 2, "t_s": 3.0}, {"tokens": 16, "rep": 3, "t_s": 4.0}]}]
    assert _per_repeat([ranks], 16, "t_s", max) == [4.0, 5.0]   # the slowest rank's
    assert _per_repeat([ranks], 16, "t_s", min) == [1.0, 3.0]   # the last to arrive's
    assert _per_repeat([ranks], 16, "t_s", np.mean) == [2.5, 4.0]


@pytest.mark.parametrize("probe", [{"seconds": 0.02}, {"seconds": 0, "processes": 2},
                                   {"seconds": 0.02, "processes": "2"}, [0.02, 2]])
def test_a_malformed_machine_probe_is_refused_before_any_launch(probe):
    from epsim.calibrate.validate import _probe_reference

    with pytest.raises(EpsimError, match="calibration.probe"):
        _probe_reference(probe)
    assert _probe_reference(None) is None
    good = {"seconds": 0.02, "processes": 2}
    assert _probe_reference(good) is good


# -- the slowest rank's lateness on shared cores (efficiency.rank_skew_by_group_s) ----------

def test_rank_skews_are_the_slowest_minus_the_mean_rank_per_timed_step():
    # [rank][step] ms; step 0 is the warm-up
    per_rank = [[50.0, 20.0, 21.0], [10.0, 22.0, 25.0], [10.0, 20.0, 23.0]]
    got = rank_skews(per_rank)
    assert got == pytest.approx([(22.0 - 62.0 / 3) / 1e3, (25.0 - 23.0) / 1e3])


def test_fit_takes_the_median_over_configurations_per_world_size():
    rows = []
    for world, batch, skew in ((2, 6, 1e-3), (2, 20, 4e-3), (2, 96, 2e-3), (4, 6, 6e-3)):
        for op in ("L0.attn", "L1.moe.dispatch.mb0"):  # every row of a configuration holds it
            rows.append({"shape": "a", "world": world, "batch": batch, "context": 40,
                         "op_id": op, "kind": "norm", "time_s": 1e-4, "rank_skew_s": skew})
    rows.append({"shape": "a", "world": 1, "batch": 6, "context": 40, "op_id": "L0.attn",
                 "kind": "norm", "time_s": 1e-4})  # one rank: no skew
    got = fit_rank_skew(pd.DataFrame(rows))
    assert got == {2: pytest.approx(2e-3), 4: pytest.approx(6e-3)}
    older = pd.DataFrame(rows).drop(columns=["rank_skew_s"])
    assert fit_rank_skew(older) == {}


def test_profile_key_is_zero_at_one_rank_linear_between_and_checked():
    eff = profile_from_dict(_with("rank_skew_by_group_s", {"2": 1e-3, "4": 6e-3})
                            ).require_efficiency()
    assert eff.rank_skew(1) == 0.0
    assert eff.rank_skew(2) == pytest.approx(1e-3)
    assert eff.rank_skew(3) == pytest.approx(3.5e-3)
    assert eff.rank_skew(8) == pytest.approx(6e-3 + 2.5e-3 * 4)  # the last two points' slope
    assert load_profile("mi300x").require_efficiency().rank_skew(8) == 0.0
    with pytest.raises(EpsimError, match="rank_skew_by_group_s.2 must be a non-negative"):
        profile_from_dict(_with("rank_skew_by_group_s", {"2": -1e-3}))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_steps_time_grows_by_its_ranks_per_nodes_skew_as_host_time(microbatches):
    model = load_model("deepseek-r1")
    plan = make_plan(model, dp=8, ep=8, microbatches=microbatches)
    batch = Batch.decode(64, 1000)
    base = simulate_step(model, plan, batch, load_profile("mi300x"), seed=2)
    skewed = simulate_step(model, plan, batch, profile_from_dict(
        _with("rank_skew_by_group_s", {"2": 1e-3, "8": 4e-3})), seed=2)
    assert skewed.step_ms == pytest.approx(base.step_ms + 4.0, rel=1e-12)
    assert skewed.breakdown_ms["launch"] == pytest.approx(base.breakdown_ms["launch"] + 4.0)
    assert sum(skewed.breakdown_ms.values()) == pytest.approx(skewed.step_ms, rel=1e-9)
    assert max(skewed.rank_ms) == pytest.approx(skewed.step_ms)
    others = {k: v for k, v in skewed.breakdown_ms.items() if k != "launch"}
    assert others == {k: v for k, v in base.breakdown_ms.items() if k != "launch"}


# -- the dispatch's host hold measured in the decode steps (in-step fit) ----------------------


def test_in_step_hold_is_a_fixed_part_plus_a_share_of_the_compute_since_the_last_exchange():
    from epsim.calibrate.comm_fit import fit_host_in_step

    rows = []
    for world, fixed, share in ((2, 3e-3, 0.1), (4, 5e-3, 0.4)):
        for j, segment in enumerate((1e-3, 5e-3, 10e-3)):
            rows.append({"shape": "a", "world": world, "batch": 6, "context": 40,
                         "op_id": f"L{j}.moe.dispatch.mb0", "kind": "dispatch", "time_s": 0.01,
                         "segment_s": segment, "host_s": fixed + share * segment})
            rows.append({"shape": "a", "world": world, "batch": 6, "context": 40,
                         "op_id": f"L{j}.moe.combine.mb0", "kind": "combine", "time_s": 0.01,
                         "segment_s": 1e-4, "host_s": (1 + j) * 1e-4 * world})
    held, share = fit_host_in_step(pd.DataFrame(rows))
    assert held["dispatch"] == {2: pytest.approx(3e-3, rel=1e-6), 4: pytest.approx(5e-3, rel=1e-6)}
    assert share == {2: pytest.approx(0.1, rel=1e-6), 4: pytest.approx(0.4, rel=1e-6)}
    assert held["combine"] == {2: pytest.approx(4e-4), 4: pytest.approx(8e-4)}
    assert fit_host_in_step(pd.DataFrame(rows).drop(columns=["host_s"])) == ({}, {})
    # a hold that is all share has a fixed part of 0, which a profile accepts (a latency not)
    for row in rows:
        if row["kind"] == "dispatch":
            row["host_s"] = 0.1 * row["segment_s"]
    held, _ = fit_host_in_step(pd.DataFrame(rows))
    assert held["dispatch"][2] == pytest.approx(0.0, abs=1e-9)
    raw = _with("a2a_host_block_by_group_s", {"dispatch": {"2": 0.0}})
    assert profile_from_dict(raw).require_efficiency().host_block("dispatch", 2) == 0.0
    with pytest.raises(EpsimError, match="a2a_latency_by_group_s.dispatch: 2 must be a positive"):
        profile_from_dict(_with("a2a_latency_by_group_s", {"dispatch": {"2": 0.0}}))


def test_a_dispatch_holds_the_host_its_share_of_the_compute_since_the_previous_exchange():
    from epsim.sim.step import StepMemo
    from epsim.sim.step.compile import compile_step

    model = load_model("deepseek-r1")
    plan = make_plan(model, dp=8, ep=8, graph_mode=False)  # eager: the host is held
    raw = _with("a2a_host_block_by_group_s", {"dispatch": {"8": 2e-4}, "combine": {"8": 1e-5}})
    raw["efficiency"]["a2a_host_block_fraction"] = {"2": 0.1, "8": 0.25}
    raw["sources"]["efficiency.a2a_host_block_fraction"] = "test"
    profile = profile_from_dict(raw)
    assert profile.require_efficiency().host_block_fraction(1) == 0.0
    assert profile.require_efficiency().host_block_fraction(4) == pytest.approx(0.15)

    memo = StepMemo()

    def release(batch, memo=memo):
        comp = compile_step(model, plan, batch, profile, memo)
        prog = comp.program
        since, want = 0.0, []
        for i, op in enumerate(comp.ops):  # the compute issued since the previous exchange
            if op.kind in ("dispatch", "combine"):
                want.append(2e-4 + 0.25 * since if op.kind == "dispatch" else 1e-5)
                since = 0.0
            elif not op.is_collective:
                since += prog.work[i, 0]
        got = [prog.host_release_s[i] for i, op in enumerate(comp.ops)
               if op.kind in ("dispatch", "combine")]
        assert got == pytest.approx(want, rel=1e-12)
        return prog.host_release_s

    first = release(Batch.decode(64, 900))  # builds the structure
    recosted = release(Batch.decode(96, 1200))  # costed on it
    assert recosted.max() > first.max()  # more compute between exchanges, a longer hold
    # a fresh build's
    assert np.array_equal(release(Batch.decode(96, 1200), StepMemo()), recosted)
    with pytest.raises(EpsimError, match="a2a_host_block_fraction.2 must be a non-negative"):
        bad = json.loads(json.dumps(raw))
        bad["efficiency"]["a2a_host_block_fraction"] = {"2": -0.1}
        profile_from_dict(bad)
