"""The EP runtime against the dense single-process reference (fp32, within 1e-4), and its trace
against the op graph. Every configuration of one world size runs in one launch of local ranks."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from epsim.model.eplb import balance_placement  # noqa: E402
from epsim.model.graph import build_step_graph  # noqa: E402
from epsim.model.ids import op_id  # noqa: E402
from epsim.model.opgraph import Batch  # noqa: E402
from epsim.model.placement import Placement  # noqa: E402
from epsim.runtime import RunOptions, launch_local, validate  # noqa: E402

TOL = 1e-4


def _write(placement: Placement, path) -> str:
    path.write_text(json.dumps(placement.to_json()))
    return str(path)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Eight configurations on 2 ranks: DBO on/off, dynamic/static, contiguous/balanced/replicated
    placements, fused/unfused graphs, the shared expert apart or inside the fused-MoE op, drawn
    cache or a real prefill."""
    folder = tmp_path_factory.mktemp("placements")
    rng = np.random.default_rng(0)
    loads = rng.gamma(0.5, 100.0, size=(3, 16)) * np.array([0, 1, 1])[:, None]
    balanced = _write(balance_placement(loads, 2), folder / "balanced.json")
    # 18 slots: experts 0 and 5 have a second replica on the other GPU
    p2l = np.tile(np.r_[np.arange(8), 5, np.arange(8, 16), 0], (3, 1))
    replicated = _write(Placement(p2l, num_gpus=2, num_logical=16), folder / "replicas.json")
    base = RunOptions(model="tiny-deepseek", world_size=2, batch=4, context=6, steps=2,
                      check=True, trace=True)
    grid = {
        "dynamic": base,
        "dynamic+dbo": base.with_(dbo=True),
        "static+dbo": base.with_(static=True, dbo=True, kv_dtype="bf16"),
        "balanced+dbo+unfused": base.with_(placement=balanced, dbo=True, unfused=True),
        "balanced+static": base.with_(placement=balanced, static=True),
        "replicated+dbo+prefill": base.with_(placement=replicated, dbo=True, batch=3,
                                             prefill=True),
        "shared-in-moe+dbo": base.with_(shared_expert_in_moe=True, dbo=True),
        "shared-in-moe+static": base.with_(shared_expert_in_moe=True, static=True),
        # 16 experts + 2 redundant with no placement given: slots wrap round (experts 0, 1 twice)
        "redundant-contiguous+dbo": base.with_(redundant_experts=2, dbo=True),
    }
    return grid, dict(zip(grid, launch_local(list(grid.values()), 2), strict=True))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("placements4")
    loads = np.random.default_rng(1).gamma(0.5, 100.0, size=(4, 32))
    balanced = _write(balance_placement(loads, 4), folder / "balanced.json")
    base = RunOptions(model="tiny-deepseek", world_size=4, batch=2, context=5, steps=2,
                      check=True)
    grid = {
        "dynamic": base,
        "static+dbo": base.with_(static=True, dbo=True),
        "wide+balanced+dbo": base.with_(model="tiny-deepseek-wide", placement=balanced,
                                        dbo=True),
        "wide+static": base.with_(model="tiny-deepseek-wide", static=True, batch=3),
        # what `epsim run --redundant-experts 4` passes: 20 slots balanced from loads, 5 a rank
        "replicated-table+dbo+static": base.with_(
            dbo=True, static=True, redundant_experts=4, placement_table=tuple(
                map(tuple, balance_placement(loads[:3, :16], 4, redundant=4)
                    .physical_to_logical.tolist()))),
    }
    return grid, dict(zip(grid, launch_local(list(grid.values()), 4), strict=True))


@pytest.mark.parametrize("fixture", ["world2", "world4"])
def test_every_configuration_matches_the_dense_reference(fixture, request):
    _, results = request.getfixturevalue(fixture)
    for name, res in results.items():
        assert res["max_rel_err"] < TOL, (name, res["max_rel_err_by_output"])
        # the stored KV cache is checked too (a rounding of the reference's own entries)
        assert set(res["max_rel_err_by_output"]) == {"logits", "hidden", "kv_cache"}
        assert res["token_mismatches"] == 0, name
        assert set(res["step_ms"]) == {"mean", "median", "p10", "p90"}
        assert res["tokens_per_s"] > 0


def test_configurations_of_one_model_decode_the_same_tokens(world2):
    grid, results = world2
    # same model, seed, inputs and KV storage: placement, DBO, shapes and fusion change nothing
    same = [n for n, o in grid.items() if o.batch == 4 and o.kv_dtype == "fp8"]
    assert len(same) == 7
    tokens = {name: results[name]["next_tokens"] for name in same}
    first = next(iter(tokens.values()))
    assert all(t == first for t in tokens.values())


def test_runtime_trace_has_the_graph_op_ids(world2):
    grid, results = world2
    for name, opts in grid.items():
        model, plan, _ = validate(opts)
        steps = range(-1 if opts.prefill else 0, opts.steps)
        for step in steps:
            batch = (Batch.prefill(opts.batch, opts.context - 1) if step < 0
                     else Batch.decode(opts.batch, opts.context + step))
            graph = build_step_graph(model, plan, batch)
            for rank in range(opts.world_size):
                ran = [e.op_id for e in results[name]["trace_events"]
                       if e.rank == rank and e.args["step"] == step]
                assert sorted(ran) == sorted(graph.ops), (name, rank, step)
                assert len(ran) == len(set(ran))


def test_collectives_are_timed_on_the_comm_stream(world2):
    _, results = world2
    for e in results["dynamic+dbo"]["trace_events"]:
        assert e.stream == ("comm" if e.kind in ("dispatch", "combine") else "compute")


def test_dbo_keeps_one_exchange_in_flight_while_the_other_microbatch_computes(world2):
    _, results = world2
    events = [e for e in results["dynamic+dbo"]["trace_events"]
              if e.rank == 0 and e.args["step"] == 1]
    by_id = {e.op_id: e for e in events}
    for layer in (1, 2):
        dispatch = by_id[op_id(layer, "moe.dispatch", 0)]
        # microbatch 1's attention was issued after mb0's dispatch went out, before its wait
        for op in ("attn.q_a", "attn.core", "attn.o_proj"):
            other = by_id[op_id(layer, op, 1)]
            assert dispatch.start_us <= other.start_us
            assert other.end_us <= dispatch.end_us
