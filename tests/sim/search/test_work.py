"""Work estimated before it starts (epsim/work.py): past the budget, one line and exit 2
before anything is simulated, unless --force."""


import pytest

from epsim.model.errors import EpsimError
from epsim.sim.spec import Scenario
from epsim.sim.workload.spec import WorkloadSpec
from epsim.work import (
    BYTES_PER_REQUEST,
    WorkBudget,
    WorkEstimate,
    check,
    check_balance,
    check_step,
    estimate,
    point_requests,
)

SMALL = WorkBudget(points=10, requests=1000, memory_fraction=0.5)


def test_the_estimate_sums_points_and_requests_and_sizes_memory_by_the_largest_point():
    work = estimate([(4, 100), (2, 300), (0, 10**9)], parallel=3)
    assert work == WorkEstimate(points=6, requests=4 * 100 + 2 * 300,
                                memory_bytes=300 * BYTES_PER_REQUEST * 3)
    assert estimate([(2, 50)], parallel=16).memory_bytes == 50 * BYTES_PER_REQUEST * 2


def test_within_the_budget_passes_and_past_it_is_one_line_naming_each_excess():
    check("sweep", WorkEstimate(10, 1000, 500), False, SMALL, memory=1000)
    with pytest.raises(EpsimError) as exc:
        check("sweep", WorkEstimate(11, 1001, 501), False, SMALL, memory=1000)
    assert str(exc.value) == (
        "sweep would run 11 points (budget 10); 1,001 simulated requests (budget 1,000); "
        "about 0.0 GB of memory (budget 50% of this machine's 0.0 GB): narrow the lists or "
        "--num-prompts, or add --force to run it anyway")
    check("sweep", WorkEstimate(11, 1001, 501), True, SMALL, memory=1000)  # --force


def test_requests_of_a_point_follow_the_run_it_will_be():
    burst = Scenario.of(model="deepseek-r1", hardware="mi300x",
                     workload=WorkloadSpec(isl=100, osl=10, concurrency=64))
    assert point_requests(burst) == 1000  # num_prompts default of a burst run
    steady = burst.with_(workload=WorkloadSpec(isl=100, osl=10, concurrency=64,
                                               num_prompts=None, measure="steady"))
    assert point_requests(steady) == 2 * 64 + 16 * 8  # two concurrencies + 16 per rank (8)
    assert point_requests(steady.with_(nodes=2)) == 2 * 64 + 16 * 16


def test_a_million_point_sweep_is_refused_before_any_work(epsim, tmp_path):
    conc = ",".join(str(c) for c in range(1, 1001))
    rates = ",".join(str(r) for r in range(1, 1001))
    r = epsim("sweep", "--model", "deepseek-r1", "--hardware", "mi300x", "--isl", "100", "--osl",
              "10", "--concurrency", conc, "--request-rate", rates, "--csv",
              str(tmp_path / "out.csv"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "epsim sweep: error: sweep would run 1,000,000 points (budget 10,000); 500,500,000 "
        "simulated requests (budget 4,000,000): narrow the lists or --num-prompts, or add "
        "--force to run it anyway"]
    assert list(tmp_path.iterdir()) == []


def test_ten_million_sharegpt_requests_are_refused(epsim):
    r = epsim("predict", "--model", "deepseek-r1", "--hardware", "mi300x", "--dataset",
              "sharegpt-like", "--num-prompts", "10000000", "--concurrency", "256")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("epsim predict: error: predict would run 10,000,000 simulated "
                               "requests (budget 4,000,000)")
    assert r.stderr.count("\n") == 1


def test_balance_refuses_a_layer_past_its_budget_unless_forced():
    check_balance((58, 256), False)  # DeepSeek-V3
    check_balance((4, 58, 2**16), True)  # --force
    with pytest.raises(EpsimError, match=r"place 2,000,000 experts a layer \(budget 65,536\): "):
        check_balance((1, 2_000_000), False)
    with pytest.raises(EpsimError, match=r"65,537 experts a layer \(budget 65,536\); "
                                         r"4,194,368 loads in all \(budget 4,194,304\)"):
        check_balance((64, 65_537), False)
    with pytest.raises(EpsimError, match=r"^balance would place 4,194,560 loads in all"):
        check_balance((16385, 256), False)


def test_a_two_million_expert_load_file_is_refused_in_one_line(epsim, tmp_path):
    loads = tmp_path / "loads.json"
    loads.write_text('{"logical_count": [[' + ",".join(["1"] * 2_000_000) + "]]}")
    r = epsim("balance", "--loads", str(loads), "--gpus", "8", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "epsim balance: error: balance would place 2,000,000 experts a layer (budget 65,536): "
        "add --force to run it anyway"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loads.json"]


def test_step_refuses_a_collective_group_whose_matrices_exceed_the_memory_budget():
    check_step(ep=8192, tp=1, force=False, memory=8 * 10**9)  # 2.1 GB of 4 GB
    with pytest.raises(EpsimError) as exc:
        check_step(ep=32768, tp=1, force=False, memory=8 * 10**9)
    assert str(exc.value) == (
        "step would run about 34.4 GB of memory (budget 50% of this machine's 8.0 GB): a "
        "smaller expert-parallel group than 32,768 GPUs, or add --force to run it anyway")
    check_step(ep=32768, tp=1, force=True, memory=8 * 10**9)
