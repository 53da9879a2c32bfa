"""The argument groups predict, sweep, tune and plan share (``epsim.common``): what their
defaults build is the library's own default scenario and search space."""

import math

from epsim.cli import build_parser
from epsim.options import scenario_from_args
from epsim.search_args import search_base_from_args, search_space_from_args
from epsim.sim.search.tune import SearchSpace
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import WorkloadSpec

R1 = ["--model", "deepseek-r1", "--hardware", "mi300x"]


def test_predict_defaults_are_the_default_scenario():
    args = build_parser().parse_args(["predict", *R1, "--isl", "2000", "--osl", "100",
                                      "--concurrency", "64"])
    assert scenario_from_args(args) == Scenario.of(
        model="deepseek-r1", hardware="mi300x",
        workload=WorkloadSpec(num_prompts=64, isl=2000, osl=100, concurrency=64))


def test_sweep_lists_are_parsed_into_tuples():
    args = build_parser().parse_args(["sweep", *R1, "--isl", "100,200", "--osl", "10",
                                      "--kv-dtype", "fp8,bf16"])
    assert (args.isl, args.osl, args.kv_dtype) == ((100, 200), (10,), ("fp8", "bf16"))
    assert len(args.request_rate) == 1 and math.isinf(args.request_rate[0])
    sc = scenario_from_args(args, isl=100, osl=10, kv_dtype="bf16", request_rate=math.inf)
    assert (sc.workload.isl, sc.deployment.execution.kv_dtype, sc.workload.num_prompts) == (100, "bf16", 1000)


def test_tune_defaults_are_the_documented_search_space():
    args = build_parser().parse_args(["tune", *R1, "--isl", "2000", "--osl", "100",
                                      "--slo", "median_itl_ms<=100"])
    assert search_space_from_args(args) == SearchSpace(
        concurrency=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), dbo=(True, False),
        graph=(True,),
        splits=(None,), kv_dtype=("fp8",))
    base = search_base_from_args(args, "h200")
    assert (base.hardware, base.workload.isl, base.workload.osl) == ("h200", 2000, 100)
    assert math.isinf(base.workload.request_rate)
    # a service level is measured in steady state, its run sized for the window
    assert (base.workload.measure, base.workload.num_prompts) == ("steady", None)
    predict = build_parser().parse_args(["predict", *R1, "--isl", "2000", "--osl", "100"])
    assert scenario_from_args(predict).workload.measure == "burst"


def test_tune_splits_and_switches_parse():
    args = build_parser().parse_args(["tune", *R1, "--isl", "100", "--osl", "10", "--slo",
                                      "median_itl_ms<=100", "--splits", "8x1,dp4xtp2,1/8",
                                      "--graph", "on,off", "--no-dbo", "--concurrency", "8,16"])
    space = search_space_from_args(args)
    assert space.splits == ((8, 1), (4, 2), (1, 8))
    assert (space.dbo, space.graph, space.concurrency) == ((False,), (True, False), (8, 16))
