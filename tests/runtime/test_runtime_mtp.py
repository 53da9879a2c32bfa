"""The runtime's MTP verify step on the tiny model: real compute (1 + N tokens per sequence
through the main model, the draft passes), simulated acceptance, checked against the dense
reference's causal multi-token decode over the cached context, and its trace against the op
graph and the simulator's issue order."""

import json

import pytest

torch = pytest.importorskip("torch")

from epsim.model.graph import build_step_graph  # noqa: E402
from epsim.model.mtp import runtime_accepted  # noqa: E402
from epsim.model.opgraph import Batch  # noqa: E402
from epsim.runtime import RunOptions, launch_local, validate  # noqa: E402
from epsim.sim.hardware.profile import load_profile  # noqa: E402
from epsim.sim.step import simulate as sim_step  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def runs():
    base = RunOptions(model="tiny-deepseek", world_size=2, batch=3, context=6, steps=3,
                      check=True, trace=True, mtp=1, mtp_acceptance=0.6)
    grid = {
        "mtp1": base,
        "mtp2+dbo": base.with_(mtp=2, dbo=True, batch=4, mtp_acceptance=0.7),
        "mtp2+static+bf16": base.with_(mtp=2, static=True, kv_dtype="bf16"),
        "mtp1+unfused": base.with_(unfused=True, mtp_acceptance=0.9),
        "mtp1+shared-in-moe+dbo": base.with_(shared_expert_in_moe=True, dbo=True, batch=4),
    }
    return grid, dict(zip(grid, launch_local(list(grid.values()), 2), strict=True))


def test_every_mtp_configuration_matches_the_dense_reference(runs):
    _, results = runs
    for name, res in results.items():
        errs = res["max_rel_err_by_output"]
        assert set(errs) == {"logits", "hidden", "kv_cache", "draft_logits"}, name
        assert res["max_rel_err"] < TOL, (name, errs)
        assert res["token_mismatches"] == 0, name


def test_sequences_advance_by_the_sampled_chain(runs):
    grid, results = runs
    for name, opts in grid.items():
        accepted = [sum(int(runtime_accepted(opts.seed, r, s, opts.batch, opts.mtp,
                                             opts.mtp_acceptance).sum()) for r in range(2))
                    for s in range(opts.steps)]
        mtp = results[name]["mtp"]
        assert mtp["accepted_per_step"] == accepted, name
        assert mtp["tokens_per_request_step"] == 1 + sum(accepted) / (2 * opts.batch * 3)
        # every verified position's token comes back: B * (1 + N) per rank and step
        assert all(len(step) == opts.batch * (1 + opts.mtp)
                   for rank in results[name]["next_tokens"] for step in rank)


def test_the_trace_has_the_graphs_ops_in_the_simulators_order(runs):
    grid, results = runs
    profile = load_profile("mi300x")
    for name in ("mtp1", "mtp2+dbo"):
        opts = grid[name]
        model, plan, placement = validate(opts)
        for step in range(opts.steps):
            batch = Batch.decode(opts.batch, opts.context + step)
            graph = build_step_graph(model, plan, batch)
            assert any(op.draft == opts.mtp - 1 for op in graph)
            simulated = sim_step.simulate_step(model, plan, batch, profile,
                                               placement=placement, trace=True)
            for rank in range(2):
                ran = [e for e in results[name]["trace_events"]
                       if e.rank == rank and e.args["step"] == step]
                assert sorted(e.op_id for e in ran) == sorted(graph.ops), (name, rank, step)
                for stream in ("compute", "comm"):
                    sim = [e.op_id for e in simulated.events
                           if e.rank == rank and e.stream == stream]
                    assert [e.op_id for e in ran if e.stream == stream] == sim


def test_epsim_run_mtp_check_passes(epsim):
    res = epsim("run", "--model", "tiny-deepseek", "--world-size", "2", "--batch", "3",
                "--context", "6", "--steps", "2", "--mtp", "1", "--check", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["max_rel_err"] < TOL and out["token_mismatches"] == 0
    assert out["mtp"]["draft_tokens"] == 1 and out["mtp"]["acceptance"] == 0.85


def test_runtime_refuses_what_it_does_not_implement_under_mtp(epsim):
    res = epsim("run", "--model", "tiny-deepseek", "--batch", "2", "--context", "6", "--mtp", "1",
                "--prefill")
    assert res.returncode == 2 and "--mtp with --prefill" in res.stderr
