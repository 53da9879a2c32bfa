"""Searches on many cores and a cluster: executors return the serial run's results in its order,
optuna finds the grid's best, the larger search spaces, and the CLI's one-object / one-line rules.
"""

import json

import pytest
from serving_models import affine_factory

from epsim.model.errors import EpsimError
from epsim.sim.scenario import StepCache
from epsim.sim.search.executors import (
    Executor,
    PoolExecutor,
    chunks,
    make_executor,
    split_diagnostics,
)
from epsim.sim.search.samplers import choose, constraint_values
from epsim.sim.search.slo import parse_slo
from epsim.sim.search.tune import SearchOptions, SearchSpace, apply_point, tune
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import WorkloadSpec

TINY = Scenario.of(model="tiny-deepseek", hardware="mi300x",
                workload=WorkloadSpec(num_prompts=16, isl=128, osl=8))
R1 = Scenario.of(model="deepseek-r1", hardware="mi300x",
              workload=WorkloadSpec(num_prompts=64, isl=1000, osl=30))
SLO = parse_slo("median_itl_ms<=100")


def _results(res):
    """A tune result without its diagnostics (what must not depend on where points ran)."""
    def strip(row):
        return None if row is None else {k: v for k, v in row.items() if k != "diagnostics"}
    return (strip(res.best), [strip(r) for r in res.frontier], [strip(r) for r in res.points],
            res.skipped, res.strategy)


def test_chunks_keep_a_group_together_and_split_only_for_idle_workers():
    items = ["a1", "b1", "a2", "a3", "b2"]
    first = lambda s: s[0]  # noqa: E731
    assert chunks(items, None, 2) == [[0], [1], [2], [3], [4]]
    assert chunks(items, first, 2) == [[0, 2, 3], [1, 4]]
    assert chunks(items, first, 3) == [[0], [2, 3], [1, 4]]
    assert chunks(items, first, 8) == [[0], [2], [3], [1], [4]]


def test_make_executor_picks_by_the_flags():
    assert type(make_executor(1)) is Executor
    assert type(make_executor(3)) is PoolExecutor and make_executor(3).workers == 3
    assert make_executor(None).workers >= 1
    assert make_executor(2, ray="auto").name == "ray"


def test_diagnostics_move_under_their_own_key():
    row = split_diagnostics({"a": 1, "sim_wall_s": 0.5, "step_sim_calls": 7})
    assert row == {"a": 1, "diagnostics": {"sim_wall_s": 0.5, "step_sim_calls": 7}}


def test_workers_2_equals_workers_1():
    space = SearchSpace(concurrency=(4, 16), dbo=(True, False), kv_dtype=("fp8", "bf16"))
    serial = tune(TINY, SLO, space)
    ticks = []
    with PoolExecutor(workers=2) as pool:
        par = tune(TINY, SLO, space, options=SearchOptions(executor=pool),
                   progress=lambda n, of: ticks.append((n, of)))
    assert _results(par) == _results(serial) and len(serial.points) == 8
    assert ticks[-1] == (8, 8) and [n for n, _ in ticks] == sorted(n for n, _ in ticks)


def test_an_error_in_a_worker_is_the_same_one_line_error():
    bad = R1.with_(mem_fraction=0.4)  # passes check_scenario; its weights do not fit in a run
    with PoolExecutor(workers=2) as pool, pytest.raises(EpsimError, match="does not fit") as exc:
        from epsim.sim.search.executors import run_scenario_task
        pool.map(run_scenario_task, [bad, bad.with_(kv_dtype="bf16")])
    assert "\n" not in str(exc.value)


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def test_a_local_ray_run_equals_serial(ray_cluster):
    space = SearchSpace(concurrency=(4, 16), dbo=(True, False))
    serial = tune(TINY, SLO, space)
    with make_executor(ray="local") as ex:
        remote = tune(TINY, SLO, space, options=SearchOptions(executor=ex))
    assert ex.describe() == {"executor": "ray", "address": "local"}
    assert _results(remote) == _results(serial)
    assert ray_cluster.is_initialized()  # an instance it did not start is left running


def test_optuna_finds_the_grids_best_on_a_small_space():
    pytest.importorskip("optuna")
    space = SearchSpace(concurrency=(8, 16, 32, 64), dbo=(True, False), kv_dtype=("fp8", "bf16"))
    slo = parse_slo("median_itl_ms<=15,p90_ttft_ms<=400")
    cache = StepCache(affine_factory(per_seq=1e-3))
    grid = tune(R1, slo, space, cache=cache)
    found = tune(R1, slo, space, cache=cache,
                 options=SearchOptions(strategy="optuna", trials=24))
    assert grid.strategy == "grid" and found.strategy == "optuna"
    assert grid.best is not None and grid.best["concurrency"] == 32
    key = ("concurrency", "dbo", "kv_dtype", "output_throughput")
    assert [found.best[k] for k in key] == [grid.best[k] for k in key]
    assert len(found.points) < space.size()  # it did not need every point
    again = tune(R1, slo, space, cache=cache, options=SearchOptions(strategy="optuna", trials=24))
    assert _results(again) == _results(found)  # seeded by the workload's seed


def test_auto_is_grid_up_to_the_threshold_and_the_constraint_is_relative():
    assert (choose("auto", 256), choose("auto", 257), choose("grid", 10**6)) == \
        ("grid", "optuna", "grid")
    slo = parse_slo("median_itl_ms<=50,output_throughput>=1000")
    assert constraint_values(slo, {"median_itl_ms": 75.0, "output_throughput": 1500.0}) == \
        [0.5, -0.5]


def test_the_further_dimensions_are_searched_and_applied():
    space = SearchSpace(concurrency=(8,), max_num_seqs=(64, 128), chunked_prefill_size=(2048,),
                        mtp=(None,))
    pts = space.points()
    assert space.size() == 2
    assert pts[0] == {"split": None, "kv_dtype": "fp8", "graph": True, "dbo": True,
                      "max_num_seqs": 64, "chunked_prefill_size": 2048, "concurrency": 8}
    sc = apply_point(R1, pts[1], None)
    f = sc.flat()
    assert (f["max_num_seqs"], f["chunked_prefill_size"], f["mtp"]) == (128, 2048, 0)
    # today's five knobs read as they always did
    assert SearchSpace(concurrency=(8,)).points() == [
        {"split": None, "kv_dtype": "fp8", "graph": True, "dbo": True, "concurrency": 8}]
    hw = SearchSpace(concurrency=(8,), hardware=("mi300x", "h200"), nodes=(1, 2), mtp=(0, 1))
    assert hw.size() == 8 and list(hw.points()[-1]) == [
        "hardware", "nodes", "split", "kv_dtype", "graph", "dbo", "mtp", "concurrency"]
    sc = apply_point(R1, hw.points()[-1], None)
    f = sc.flat()
    assert (f["hardware"], f["nodes"], f["mtp"]) == ("h200", 2, 1)


TUNE = ["tune", "--model", "tiny-deepseek", "--hardware", "mi300x", "--isl", "128", "--osl",
        "8", "--concurrency", "4,16", "--slo", "median_itl_ms<=100", "--json"]


def test_tune_cli_workers_2_equals_workers_1(epsim):
    one, two = (json.loads(epsim(*TUNE, "--workers", w).stdout) for w in ("1", "2"))
    assert one["diagnostics"]["executor"] == "serial"
    assert two["diagnostics"] == {**two["diagnostics"], "executor": "pool", "workers": 2}
    for out in (one, two):
        del out["diagnostics"]
        for row in [out["best"], *out["frontier"], *out["points"]]:
            assert set(row.pop("diagnostics")) == {"sim_wall_s", "step_sim_calls"}
    assert one == two


def test_a_worker_error_on_the_command_line_is_one_line_exit_2(epsim):
    res = epsim("sweep", "--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "1000",
                "--osl", "10", "--concurrency", "8,16", "--mem-fraction", "0.4", "--workers", "2",
                "--json")
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit" in lines[0]


@pytest.mark.parametrize("argv, needle", [
    (TUNE + ["--ray", "nowhere"], "--ray takes auto, local or HOST:PORT"),
    (TUNE + ["--search", "random"], "one of auto, grid, optuna"),
    (TUNE + ["--workers", "0"], "an integer in [1, 2**12]"),
    (["plan", *TUNE[1:-1], "--nodes", "1,2", "--target-output-throughput", "100"],
     "takes one value"),
])
def test_bad_search_flags_are_one_line(epsim, argv, needle):
    res = epsim(*argv)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
