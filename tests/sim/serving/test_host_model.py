"""The engine's per-step host work: fixed + per request + per token + the DP ranks' sync, on
the busiest rank, overlapped with the GPU or added to it (sim/serving/step_time.py, presets)."""

import argparse

import numpy as np
import pytest
from serving_models import Affine

from epsim.options import add_scenario_args, scenario_from_args
from epsim.sim.serving import ServingConfig, simulate_serving
from epsim.sim.serving.presets import EngineContext, EngineOverrides, engine_settings
from epsim.sim.serving.step_time import EngineStepTime, StepPolicy
from epsim.sim.workload.spec import Requests

GB = 1e9


def deployment(dp: int) -> EngineContext:
    return EngineContext(hbm_bytes=192 * GB, dp=dp, tp=1, kv_capacity_tokens=1_000_000,
                         context_len=163_840)


def test_vllm_host_time_at_two_batch_sizes():
    # 0.62 ms / 32 = 19.375 us per request; 0.1 ms DP sync only when dp > 1
    dp8 = engine_settings("vllm", deployment(8)).step_policy(graph=False)
    assert dp8.host_seconds(32) == pytest.approx(0.1e-3 + 32 * 19.375e-6)  # 0.72 ms
    assert dp8.host_seconds(450) == pytest.approx(0.1e-3 + 450 * 19.375e-6)  # 8.81875 ms
    dp1 = engine_settings("vllm", deployment(1)).step_policy(graph=True)
    assert dp1.host_seconds(32) == pytest.approx(0.62e-3)
    # the busiest rank sets it: ranks of 10 and 450 requests pay the 450
    assert dp8.host_seconds(np.array([10, 450]), np.array([10, 450])) == pytest.approx(
        8.81875e-3)
    # SGLang keeps its flat 4 ms whatever the batch
    sg = engine_settings("sglang", deployment(8)).step_policy(graph=True)
    assert sg.host_seconds(1) == sg.host_seconds(4000) == pytest.approx(4e-3)


def test_a_step_shorter_than_the_host_is_host_bound_and_overlap_on_off():
    policy = engine_settings("vllm", deployment(8)).step_policy(graph=True)
    on = EngineStepTime.of(Affine(), policy)
    # 450 requests: host 8.81875 ms; a 1 ms GPU step lasts the host's, a 20 ms one its own
    assert on.wall(0.001, 450) == pytest.approx(8.81875e-3)
    assert on.wall(0.020, 450) == pytest.approx(0.020)
    off = engine_settings("vllm", deployment(8), EngineOverrides(host_overlap=False))
    assert off.sources["host_overlap"] == "flag" and not off.host_overlap
    added = EngineStepTime.of(Affine(), off.step_policy(graph=True))
    assert added.wall(0.020, 450) == pytest.approx(0.020 + 8.81875e-3)
    assert added.wall(0.001, 32) == pytest.approx(0.001 + 0.72e-3)


def test_host_ms_per_step_pins_a_flat_value():
    s = engine_settings("vllm", deployment(8), EngineOverrides(host_ms_per_step=4.0))
    assert (s.host_ms_per_step, s.host_us_per_request, s.host_us_per_token,
            s.host_dp_sync_ms) == (4.0, 0.0, 0.0, 0.0)
    assert s.step_policy(graph=True).host_seconds(450) == pytest.approx(4e-3)
    host = s.echo()["host"]
    assert host["fixed_ms"] == 4.0 and host["sources"]["host_us_per_request"] == "flag"
    # the preset's echo names each term's source
    echoed = engine_settings("vllm", deployment(8)).echo()["host"]
    assert echoed["per_request_us"] == 19.375 and echoed["dp_sync_ms"] == 0.1
    assert "tenstorrent/vllm#305" in echoed["sources"]["host_us_per_request"]
    assert "assumption" in echoed["sources"]["host_dp_sync_ms"]


def test_the_serving_loop_pays_the_host_by_the_ranks_requests():
    # one rank, 3 requests of 10 in / 3 out; prefill 10 ms, decode 1 ms; the host 2 ms per
    # request: the prefill step (3 chunks) stays 10 ms, each decode step of 3 is host-bound
    # at 6 ms, and without overlap it is 1 + 6 ms
    req = Requests(np.array([10, 10, 10]), np.array([3, 3, 3]), np.zeros(3))
    cfg = ServingConfig(dp=1, kv_capacity_tokens=10**6, scheduler="decode_first")
    for overlap, decode_s in ((True, 0.006), (False, 0.007)):
        costs = EngineStepTime.of(Affine(base=0.001, p_base=0.01),
                                  StepPolicy(host_per_request_s=0.002, host_overlap=overlap))
        run = simulate_serving(req, cfg, costs)
        prefill_s = 0.01 if overlap else 0.016
        assert [s.seconds for s in run.steps] == pytest.approx([prefill_s, decode_s, decode_s])


def test_no_host_overlap_flag_reaches_the_scenario():
    p = argparse.ArgumentParser()
    add_scenario_args(p)
    base = ["--model", "deepseek-r1", "--hardware", "mi300x"]
    assert scenario_from_args(p.parse_args([*base, "--no-host-overlap"])).deployment.engine.host_overlap is False
    assert scenario_from_args(p.parse_args(base)).deployment.engine.host_overlap is None  # the engine's own
