"""SLO parsing, tune against brute force, plan's sizing, and the commands' one-line errors."""

import itertools
import math

import pytest
from serving_models import affine_factory

from epsim.model.errors import EpsimError
from epsim.sim.scenario import StepCache, run_scenario
from epsim.sim.search.capacity import plan_capacity
from epsim.sim.search.slo import parse_slo, with_slo_metrics
from epsim.sim.search.tune import SearchSpace, apply_point, pareto_frontier, tune
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import WorkloadSpec

BASE = Scenario.of(model="deepseek-r1", hardware="mi300x",
                workload=WorkloadSpec(num_prompts=64, isl=1000, osl=30))


def test_parse_slo():
    slo = parse_slo("median_itl_ms<=100, p90_ttft_ms<5000,output_throughput>=10")
    assert slo.terms == (("median_itl_ms", "<=", 100.0), ("p90_ttft_ms", "<", 5000.0),
                         ("output_throughput", ">=", 10.0))
    assert slo.percentiles() == (90.0,) and slo.metrics() == ("ttft",)
    assert slo.met({"median_itl_ms": 100, "p90_ttft_ms": 4999, "output_throughput": 11})
    assert not slo.met({"median_itl_ms": 100.1, "p90_ttft_ms": 1, "output_throughput": 11})
    sc = with_slo_metrics(BASE.with_(percentiles=(50.0,), percentile_metrics=("itl",)),
                          parse_slo("p95_e2el_ms<=9"))
    m = sc.measurement
    assert m.percentiles == (50.0, 95.0) and m.percentile_metrics == ("itl", "e2el")


@pytest.mark.parametrize("text, match", [
    ("median_itl_ms=<100", "does not parse"),
    ("median_itl<=100", "unknown SLO metric"),
    ("p90_foo_ms<=3", "unknown SLO metric"),
    ("p190_itl_ms<=3", "percentile"),
    ("", "empty SLO"),
])
def test_bad_slo(text, match):
    with pytest.raises(EpsimError, match=match):
        parse_slo(text)


def test_frontier():
    pts = [{"t": 10, "l": 5}, {"t": 8, "l": 6}, {"t": 12, "l": 9}, {"t": 3, "l": 1}]
    assert pareto_frontier(pts, "t", "l") == [pts[3], pts[0], pts[2]]


def test_tune_agrees_with_brute_force():
    space = SearchSpace(concurrency=(8, 16, 32, 64), dbo=(True, False), graph=(True, False),
                        kv_dtype=("fp8", "bf16"))
    slo = parse_slo("median_itl_ms<=15,p90_ttft_ms<=400")
    res = tune(BASE, slo, space, cache=StepCache(affine_factory(per_seq=1e-3)))
    assert len(res.points) == 32
    # brute force, independently: every combination, run, filter, maximise
    cache = StepCache(affine_factory(per_seq=1e-3))
    best = None
    base = with_slo_metrics(BASE, slo)
    for c, dbo, graph, kv in itertools.product((8, 16, 32, 64), (True, False), (True, False),
                                               ("fp8", "bf16")):
        r = run_scenario(apply_point(base, {"concurrency": c, "dbo": dbo, "graph": graph,
                                            "kv_dtype": kv}, None), cache)
        if r["median_itl_ms"] <= 14.5 and r["p90_ttft_ms"] <= 400:
            if best is None or r["output_throughput"] > best[0]:
                best = (r["output_throughput"], c, dbo, graph, kv)
    assert best is not None and best[1:] == (32, True, True, "fp8")
    b = res.best
    assert (b["output_throughput"], b["concurrency"], b["dbo"], b["graph"], b["kv_dtype"]) \
        == pytest.approx(best)
    # the SLO binds: the unconstrained best is a larger, slower point
    top = max(res.points, key=lambda r: r["output_throughput"])
    assert top["output_throughput"] > b["output_throughput"] and not top["meets_slo"]


def test_plan_serves_the_target_at_its_per_node_throughput():
    space = SearchSpace(concurrency=(16, 64), dbo=(True,))
    slo = parse_slo("median_itl_ms<=50")
    target = 50_000.0
    plans = plan_capacity(BASE, slo, target, space, hardware=["mi300x", "h200"],
                          unit_layouts=[None, (1, 1)], gpu_hour_usd={"mi300x": 2.0, "*": 3.0},
                          cache=StepCache(affine_factory()))
    assert {p.hardware for p in plans} == {"mi300x", "h200"}
    for p in plans:
        served = p.nodes * p.per_node_output_throughput
        assert served >= target
        assert (p.nodes - p.unit_nodes) * p.per_node_output_throughput < target
        assert p.nodes == p.prefill_nodes + p.decode_nodes
        assert p.gpus == p.nodes * 8
        price = 2.0 if p.hardware == "mi300x" else 3.0
        assert p.cost_per_hour_usd == pytest.approx(p.gpus * price)
        assert p.usd_per_million_output_tokens == pytest.approx(
            p.cost_per_hour_usd / (target * 3600) * 1e6)
    assert plans[0].cost_per_hour_usd <= plans[-1].cost_per_hour_usd


def test_plan_with_no_feasible_point_returns_nothing():
    plans = plan_capacity(BASE, parse_slo("median_itl_ms<=0.001"), 1000.0,
                          SearchSpace(concurrency=(8,)), hardware=["mi300x"],
                          unit_layouts=[None], cache=StepCache(affine_factory()))
    assert plans == []


def test_disagg_split_must_match_nodes():
    with pytest.raises(EpsimError, match="needs 3 nodes"):
        run_scenario(BASE.with_(nodes=2, disagg=(2, 1)), StepCache(affine_factory()))


def test_disagg_scenario_runs_with_transfer():
    r = run_scenario(BASE.with_(disagg=(1, 1)), StepCache(affine_factory()))
    assert r["nodes"] == 2 and r["gpus"] == 16 and r["prefill_dp"] == 8
    # R1 FP8 KV: 35136 B/token x 1000 tokens over a 50 GB/s NIC
    assert r["kv_transfer_ms_per_request"] == pytest.approx(35136 * 1000 / 50e9 * 1e3)
    assert r["completed"] == 64 and math.isfinite(r["mean_ttft_ms"])


# --- the commands' one-line errors (they fail before any step is simulated) -------------------

PREDICT = ["predict", "--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "100",
           "--osl", "10", "--concurrency", "4"]


@pytest.mark.parametrize("argv, needle", [
    (["tune", "--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "100", "--osl", "10",
      "--slo", "median_itl_ms=<100"], "does not parse"),
    (["tune", "--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "100", "--osl", "10",
      "--slo", "median_latency_ms<=100"], "unknown SLO metric"),
    (PREDICT + ["--percentile-metrics", "ttft,latency"], "unknown percentile metric"),
    (PREDICT + ["--num-prompts", "0"], "num-prompts"),
    (PREDICT + ["--nodes", "2", "--disagg", "2:1"], "needs 3 nodes"),
    (PREDICT + ["--disagg", "2:0"], "P:D"),
    (["plan", "--model", "deepseek-r1", "--isl", "100", "--osl", "10", "--slo",
      "median_itl_ms<=1", "--target-output-throughput", "0"], "expected a number in (0, 1e+10]"),
])
def test_bad_input_is_one_line_exit_2(epsim, argv, needle):
    res = epsim(*argv)
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr


class _Tty:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


@pytest.mark.parametrize("tty, enabled, shown", [(True, True, True), (False, True, False),
                                                  (True, False, False)])
def test_progress_bar_only_on_a_terminal_without_json(monkeypatch, tty, enabled, shown):
    from epsim.common import Progress

    fake = _Tty(tty)
    monkeypatch.setattr("sys.stderr", fake)
    monkeypatch.setenv("TERM", "xterm")
    bar = Progress("tune", enabled=enabled, width=10)
    bar(1, 4)
    bar(4, 4)
    bar.close()
    assert ("[##########] 4/4" in fake.text) == shown
    assert (fake.text.endswith("\n")) == shown
