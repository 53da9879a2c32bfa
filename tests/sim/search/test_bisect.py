"""Bisection (``--search bisect``): the boundary of a monotone metric, vLLM's probe order, the
search over deployments on one worker or two, goodput as the objective, and the one-line
refusals."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epsim.model.errors import EpsimError
from epsim.sim.search.bisect import (
    RATE_RESOLUTION,
    bisect,
    bisect_search,
    boundaries,
    check_monotone,
    max_probes,
    next_probe,
    probe_budget,
)
from epsim.sim.search.executors import PoolExecutor
from epsim.sim.search.slo import parse_slo
from epsim.sim.search.tune import SearchOptions, SearchSpace, tune
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import WorkloadSpec

TINY = Scenario.of(model="tiny-deepseek", hardware="mi300x",
                workload=WorkloadSpec(num_prompts=None, isl=128, osl=8, measure="steady"))


def test_probe_order_is_vllms_top_bottom_then_inside():
    assert next_probe({}, 1, 4096, True) == 4096
    assert next_probe({4096: True}, 1, 4096, True) is None  # met at the top: done
    assert next_probe({4096: False}, 1, 4096, True) == 1
    assert next_probe({4096: False, 1: False}, 1, 4096, True) is None  # met nowhere
    assert next_probe({4096: False, 1: True}, 1, 4096, True) == 64  # sqrt(1 * 4096)
    assert next_probe({4096: False, 1: True, 64: True}, 1, 4096, True) == 512
    assert next_probe({8: False, 1: True, 2: True, 3: False}, 1, 8, True) is None  # adjacent
    assert next_probe({8: False, 1: True, 2: True}, 1, 8, True) == 4  # round(sqrt(16))
    assert next_probe({8: False, 1: None}, 1, 8, True) is None  # cannot run at all


@settings(max_examples=300, deadline=None)
@given(lo=st.integers(1, 64), width=st.integers(0, 5000), offset=st.integers(-3, 5003))
def test_bisection_finds_the_boundary_of_a_monotone_integer_metric(lo, width, offset):
    hi = lo + width
    edge = lo + offset  # the metric is met up to here
    found, history = bisect(lambda v: v <= edge, lo, hi, integer=True)
    assert found == (min(edge, hi) if edge >= lo else None)
    assert len(history) <= max_probes(lo, hi, True)
    if found is not None and found < hi:  # the next integer was tried and failed
        assert history[found + 1] is False


@settings(max_examples=300, deadline=None)
@given(edge=st.floats(0.05, 2000.0))
def test_bisection_finds_a_rate_boundary_within_its_resolution(edge):
    lo, hi = 0.125, 1024.0
    found, history = bisect(lambda v: v <= edge, lo, hi, integer=False)
    assert len(history) <= max_probes(lo, hi, False)
    if edge < lo:
        assert found is None
    elif edge >= hi:
        assert found == hi
    else:
        failing = min(v for v, met in history.items() if not met)
        assert found <= edge < failing <= found * (1 + RATE_RESOLUTION)


def test_max_probes_is_reached_and_never_passed_on_1_to_4096():
    worst = max(len(bisect(lambda v, e=e: v <= e, 1, 4096, True)[1]) for e in range(0, 4097))
    assert worst == max_probes(1, 4096, True) == 18


@pytest.mark.parametrize("text", ["output_throughput>=100", "median_itl_ms>=5",
                                  "expert_imbalance<=1.2"])
def test_terms_more_load_does_not_break_are_refused(text):
    with pytest.raises(EpsimError, match="not broken by more load"):
        check_monotone(parse_slo(text))
    check_monotone(parse_slo("p99_ttft_ms<=5000,mean_tpot_ms<100,kv_cache_usage<=0.9"))


def _synthetic_evaluate(calls):
    """A deployment's metric rises with concurrency, faster with DBO off: ITL = c (on) or 2c."""
    def evaluate(points, _progress):
        calls.append(len(points))
        return [("ok", {"median_itl_ms": p["concurrency"] * (1 if p["dbo"] else 2)})
                for p in points]
    return evaluate


def test_each_deployment_is_bisected_and_probed_in_rounds():
    space = SearchSpace(concurrency=(1, 100), dbo=(True, False))
    slo = parse_slo("median_itl_ms<=37")
    calls = []
    found = bisect_search([], _synthetic_evaluate(calls), None, dimensions=space.dimensions(),
                          slo=slo, variable="max_concurrency", point_at=space.point_at)
    rows = boundaries(found, "max_concurrency", slo)
    assert [(r["deployment"]["dbo"], r["max_concurrency"]) for r in rows] == [(True, 37),
                                                                               (False, 18)]
    assert calls[:2] == [2, 2]  # one round probes every open deployment at once
    assert len(found) <= probe_budget(space.dimensions(), "max_concurrency")


def test_an_overloaded_probe_breaks_the_slo_a_skipped_one_ends_the_deployment():
    space = SearchSpace(concurrency=(None,), request_rate=(1.0, 64.0))
    slo = parse_slo("mean_ttft_ms<=100")

    def evaluate(points, _progress):  # above 10 req/s the window is empty
        return [("ok", {"mean_ttft_ms": 10.0}) if p["request_rate"] <= 10
                else ("overload", "no steady window") for p in points]
    found = bisect_search([], evaluate, None, dimensions=space.dimensions(), slo=slo,
                          variable="request_rate", point_at=space.point_at)
    (row,) = boundaries(found, "request_rate", slo)
    assert 10 / (1 + RATE_RESOLUTION) <= row["request_rate"] <= 10

    def skip(points, _progress):
        return [("skip", "weights do not fit")] * len(points)
    found = bisect_search([], skip, None, dimensions=space.dimensions(), slo=slo,
                          variable="request_rate", point_at=space.point_at)
    assert len(found) == 1 and boundaries(found, "request_rate", slo)[0]["request_rate"] is None


def _strip(res):
    def row(r):
        return None if r is None else {k: v for k, v in r.items() if k != "diagnostics"}
    return (row(res.best), [row(r) for r in res.points], res.boundaries, res.skipped)


def test_bisect_on_two_workers_equals_serial_and_its_boundary_holds():
    space = SearchSpace(concurrency=(1, 256), dbo=(False,), kv_dtype=("fp8", "bf16"))
    slo = parse_slo("mean_tpot_ms<=0.5")  # flat to 64, 0.41 ms at 128, 0.72 at 256
    opts = SearchOptions(strategy="bisect")
    serial = tune(TINY, slo, space, options=opts)
    with PoolExecutor(workers=2) as pool:
        par = tune(TINY, slo, space, options=SearchOptions(strategy="bisect", executor=pool))
    assert _strip(par) == _strip(serial) and serial.strategy == "bisect"
    for b in serial.boundaries:  # the boundary met the SLO, the next concurrency did not
        c = b["max_concurrency"]
        rows = {r["concurrency"]: r for r in serial.points if r["kv_dtype"] ==
                b["deployment"]["kv_dtype"]}
        assert 128 < c < 256 and rows[c]["meets_slo"] and not rows[c + 1]["meets_slo"]


def test_goodput_objective_needs_goodput_slos():
    space = SearchSpace(concurrency=(4, 8), dbo=(False,))
    with pytest.raises(EpsimError, match="--goodput"):
        tune(TINY, parse_slo("mean_tpot_ms<=100"), space, objective="goodput")
    res = tune(TINY.with_(goodput=(("tpot", 100.0),)), parse_slo("mean_tpot_ms<=100"), space,
               objective="goodput")
    assert res.objective == "request_goodput" and res.best["request_goodput"] > 0


TUNE = ["tune", "--model", "tiny-deepseek", "--hardware", "mi300x", "--isl", "128", "--osl",
        "8", "--dbo", "off", "--search", "bisect", "--workers", "1"]


def test_tune_cli_reports_each_deployments_boundary(epsim):
    out = json.loads(epsim(*TUNE, "--concurrency", "1,256", "--slo", "mean_tpot_ms<=0.5",
                           "--json").stdout)
    assert out["search"] == "bisect"
    (b,) = out["boundaries"]
    assert out["best"]["concurrency"] == b["max_concurrency"] and out["best"]["meets_slo"]
    assert 128 < b["max_concurrency"] < 256
    text = epsim(*TUNE, "--concurrency", "1,256", "--slo", "mean_tpot_ms<=0.5").stdout
    assert "highest max_concurrency meeting the SLO" in text and f": {b['max_concurrency']} (" \
        in text


@pytest.mark.parametrize("extra, needle", [
    (["--slo", "output_throughput>=5"], "not broken by more load"),
    (["--slo", "mean_tpot_ms<=6", "--sla-variable", "request_rate", "--request-rate", "4"],
     "give two finite rates"),
    (["--slo", "mean_tpot_ms<=6", "--objective", "goodput"], "--goodput"),
    (["--slo", "mean_tpot_ms<=6", "--sla-variable", "qps"], "--sla-variable"),
])
def test_bisect_refusals_are_one_line(epsim, extra, needle):
    res = epsim(*TUNE, *extra)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]


def test_plan_reports_each_units_boundary(epsim):
    out = json.loads(epsim("plan", *TUNE[1:], "--concurrency", "1,256", "--slo",
                           "mean_tpot_ms<=0.5", "--target-output-throughput", "100000",
                           "--json").stdout)
    (b,) = out["boundaries"]
    assert b["hardware"] == "mi300x" and b["layout"] is None
    assert out["plans"][0]["unit"]["concurrency"] == b["max_concurrency"]
