"""A scenario's nested groups and their flat names (``epsim.sim.spec``)."""

import dataclasses

import pytest

from epsim.model.errors import EpsimError
from epsim.model.fields import options_of
from epsim.sim.spec import FLAT_NAMES, Deployment, ExecutionSpec, Scenario
from epsim.sim.workload.spec import WorkloadSpec

W = WorkloadSpec(isl=100, osl=10, concurrency=4)


def test_flat_names_reach_each_field_once():
    sc = Scenario.of(model="deepseek-r1", hardware="mi300x", workload=W, dp=8, ep=8, dbo=True,
                     engine="sglang", max_num_seqs=32, instance_nodes=1, step_mode="exact",
                     goodput=(("ttft", 500.0),))
    assert sc.deployment.plan.dp == 8 and sc.deployment.execution.dbo is True
    assert sc.deployment.engine.engine == "sglang" and sc.deployment.engine.max_num_seqs == 32
    assert sc.deployment.instances.instance_nodes == 1 and sc.simulation.step_mode == "exact"
    assert sc.measurement.goodput == (("ttft", 500.0),)
    flat = sc.flat()
    assert set(flat) == set(FLAT_NAMES) and flat["dp"] == 8 and flat["workload"] == W
    again = Scenario.of(**{k: v for k, v in flat.items()})
    assert again == sc


def test_with_changes_one_field_and_refuses_an_unknown_one():
    sc = Scenario.of(model="deepseek-r1", hardware="mi300x", workload=W)
    changed = sc.with_(kv_dtype="bf16", hardware="h200")
    assert changed.deployment.execution.kv_dtype == "bf16" and changed.hardware == "h200"
    assert sc.deployment.execution.kv_dtype == "fp8"  # frozen: the original stands
    with pytest.raises(EpsimError, match="no field 'dpp'"):
        sc.with_(dpp=8)


def test_every_option_field_has_a_flag_and_help():
    for cls in (Deployment, ExecutionSpec, WorkloadSpec):
        for f, opt in options_of(cls):
            assert opt.flag.startswith("--") and opt.help, f.name
    assert {f.name for f in dataclasses.fields(ExecutionSpec)} <= set(FLAT_NAMES)
