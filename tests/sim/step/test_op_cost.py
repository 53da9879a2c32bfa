"""One op's cost (sim/step/cost/): the scalar and the vector paths give the same bits, and the
families own every op kind once.

For every op of every shipped model's decode and prefill step (dp 8, ep 8) on two shipped
profiles: (1) the one roofline function ``roof`` over every compute op's (FLOPs, bytes, rates)
at once equals ``roof`` at each op alone; (2) an op's own time (``op_time``: one table value,
the scalar lookup) equals the routed path's array lookup at that value (two copies of it),
kernel tables and the roofline alike."""

import numpy as np
import pytest

from epsim.model import Batch, build_step_graph, load_model, make_plan
from epsim.model.config import shipped_models
from epsim.model.opgraph import OP_KINDS
from epsim.sim.hardware.kernel_tables import FEATURES
from epsim.sim.hardware.profile import load_profile
from epsim.sim.step.cost import (
    FAMILIES,
    KIND_COSTING,
    attention,
    comm,
    elementwise,
    gemm,
    roof,
    timing,
)
from epsim.sim.step.cost import roofline as R
from epsim.sim.step.cost.registry import op_features

PROFILES = ("mi300x", "h800")
_FAMILY_MODULES = {"gemm": gemm, "attention": attention, "comm": comm,
                   "elementwise": elementwise}


def _graphs():
    for name in shipped_models():
        model = load_model(name)
        plan = make_plan(model, dp=8, ep=8)
        for batch in (Batch.decode(64, 1000), Batch.prefill(2, 512)):
            yield name, model, build_step_graph(model, plan, batch)


GRAPHS = list(_graphs())


def test_every_op_kind_has_one_family():
    assert tuple(KIND_COSTING) == OP_KINDS
    for kind, family in FAMILIES.items():
        module = _FAMILY_MODULES[family]
        assert kind in module.KINDS and module.COSTING[kind] is KIND_COSTING[kind]
    assert sorted(k for m in _FAMILY_MODULES.values() for k in m.KINDS) == sorted(OP_KINDS)


def test_a_familys_table_features_are_the_kernel_tables_names():
    # the names live in hardware/ (the profile parser reads tables by them); a family's
    # features give exactly those names for every op it can describe
    for _, model, graph in GRAPHS[:4]:
        for op in graph:
            f = op_features(op, model.moe.top_k if model.moe else None)
            if f is not None:
                assert set(f) == {n for n, _ in FEATURES[op.kind]}, op.id


@pytest.mark.parametrize("profile_name", PROFILES)
def test_the_roofline_over_every_op_equals_it_at_each_op(profile_name):
    profile = load_profile(profile_name, "none")
    for _, _, graph in GRAPHS:
        ops = [op for op in graph if not op.is_collective]
        flops = np.array([op.flops for op in ops])
        moved = np.array([op.bytes for op in ops])
        rate = np.array([R.achievable_flops(profile, R.streaming_dtype(op, profile))
                         for op in ops])
        bw = R.achievable_bandwidth(profile)
        many = roof(flops, moved, rate, bw)
        one = [float(roof(op.flops, op.bytes, r, bw)) for op, r in zip(ops, rate, strict=True)]
        assert many.tolist() == one


@pytest.mark.parametrize("profile_name", PROFILES)
def test_an_ops_own_time_equals_the_array_path_at_its_value(profile_name):
    profile = load_profile(profile_name)
    assert profile.active_kernels is not None
    timed = set()
    for name, model, graph in GRAPHS:
        top_k = model.moe.top_k if model.moe else None
        for op in graph:
            nodes = np.zeros(op.dims["group_size"], dtype=np.int64) if op.is_collective else None
            if not timing.answered_by_table(op, profile, top_k=top_k, nodes=nodes):
                continue
            value = op_features(op, top_k)
            swept = [n for n, _ in FEATURES[op.kind]][-1]
            one = timing.op_seconds(op, profile, lambda: -1.0, top_k=top_k, nodes=nodes)
            two = timing.routed_seconds(op, profile, lambda v=value[swept]: np.array([v, v]),
                                        lambda: np.full(2, -1.0), top_k=top_k, nodes=nodes)
            assert two.tolist() == [one, one], (name, op.id)
            timed.add(op.kind)
    assert {"gemm", "dispatch"} <= timed
