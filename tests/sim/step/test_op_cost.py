"""One op's cost (sim/step/cost/): the scalar and the vector paths give the same bits, and the
families own every op kind once.

For every op of every shipped model's decode and prefill step (dp 8, ep 8) on two shipped
profiles (and the calibrated CPU one, whose roofline sums its terms): (1) the one roofline
function ``roof`` over every compute op's (FLOPs, bytes, rates) at once equals ``roof`` at each
op alone; (2) each family's vector form (``times(ops, ctx)``) over all ops of a kind, and over
all of the family's ops mixed, equals element by element the scalar cost of each op
(``KindCosting.seconds``, the roofline ``op_time`` reads), in a bare context and in a step's
(two nodes, captured, hierarchical exchanges); (3) an op's own time (``op_time``: one table
value, the scalar lookup) equals the routed path's array lookup at that value (two copies of
it), kernel tables and the roofline alike."""

from pathlib import Path

import numpy as np
import pytest

from epsim.model import Batch, build_step_graph, load_model, make_plan
from epsim.model.config import shipped_models
from epsim.model.opgraph import OP_KINDS
from epsim.sim.hardware.a2a import A2A_MODES
from epsim.sim.hardware.kernel_tables import FEATURES
from epsim.sim.hardware.profile import load_profile
from epsim.sim.step.cost import (
    FAMILIES,
    KIND_COSTING,
    CostContext,
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
#: a calibrated CPU profile: its roofline adds the two terms, each with its kind's factor
CPU = str(Path(__file__).resolve().parents[3] / "src/epsim/calibrate/data/cpu-2core/cpu-fitted.json")
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


def _contexts(profile, top_k):
    """A bare context (an op on its own) and a step's: two nodes of four GPUs, captured, the
    hierarchical exchange mode, the EP layout."""
    yield CostContext(profile)
    yield CostContext(profile, top_k, captured=True, mode=A2A_MODES["normal"], layout="ep",
                      nodes=(0, 0, 0, 0, 1, 1, 1, 1), tp=1)


@pytest.mark.parametrize("profile_name", (*PROFILES, CPU))
def test_each_familys_vector_form_equals_its_scalar_cost_at_every_op(profile_name):
    profile = load_profile(profile_name, "none")
    met = set()
    for name, model, graph in GRAPHS:
        top_k = model.moe.top_k if model.moe else None
        for ctx in _contexts(profile, top_k):
            for family, module in _FAMILY_MODULES.items():
                ops = [op for op in graph if FAMILIES[op.kind] == family]
                if not ops:
                    continue
                one = [KIND_COSTING[op.kind].seconds(op, ctx) for op in ops]
                assert all(isinstance(t, float) for t in one)
                # the whole family's ops at once, then each kind's alone
                assert module.times(ops, ctx).tolist() == one, (name, family)
                for kind in module.KINDS:
                    rows = [i for i, op in enumerate(ops) if op.kind == kind]
                    if rows:
                        many = module.times([ops[i] for i in rows], ctx)
                        assert many.tolist() == [one[i] for i in rows], (name, kind)
                        met.add(kind)
    assert met >= {"gemm", "grouped_gemm", "lm_head", "attention_decode", "attention_prefill",
                   "dispatch", "combine", "norm"}


@pytest.mark.parametrize("profile_name", PROFILES)
def test_an_ops_own_time_equals_the_array_path_at_its_value(profile_name):
    profile = load_profile(profile_name)
    assert profile.active_kernels is not None
    timed = set()
    for name, model, graph in GRAPHS:
        top_k = model.moe.top_k if model.moe else None
        for op in graph:
            nodes = (0,) * op.dims["group_size"] if op.is_collective else None
            ctx = CostContext(profile, top_k, nodes=nodes)
            if not timing.answered_by_table(op, ctx):
                continue
            value = op_features(op, top_k)
            swept = [n for n, _ in FEATURES[op.kind]][-1]
            one = timing.op_seconds(op, ctx, lambda: -1.0)
            two = timing.routed_seconds(op, ctx, lambda v=value[swept]: np.array([v, v]),
                                        lambda: np.full(2, -1.0))
            assert two.tolist() == [one, one], (name, op.id)
            timed.add(op.kind)
    assert {"gemm", "dispatch"} <= timed
