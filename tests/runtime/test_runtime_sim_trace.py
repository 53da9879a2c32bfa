"""The runtime and the simulator run the same op graph in the same order: their traces of one
configuration issue the same op ids in the same sequence on every rank and stream (docs/design.md
section 2.1: an op only one of them knows, or one issued out of turn, is a bug)."""

import pytest

pytest.importorskip("torch")

from epsim.model.opgraph import Batch  # noqa: E402
from epsim.runtime import RunOptions, launch_local, validate  # noqa: E402
from epsim.sim.hardware.profile import load_profile  # noqa: E402
from epsim.sim.step import simulate as sim_step  # noqa: E402


def assert_same_issue_order(grid: list[RunOptions], profile: str) -> list[dict]:
    """Run ``grid`` on 2 CPU ranks and simulate each configuration's prefill and decode step on
    ``profile``: the same op ids in the same order on every rank and stream. -> the runs."""
    runs = launch_local(grid, 2)
    for opts, measured in zip(grid, runs, strict=True):
        model, plan, placement = validate(opts)
        # step -1 is the prefill of context - 1 prompt tokens, step 0 the decode step
        for step, batch in ((-1, Batch.prefill(opts.batch, opts.context - 1)),
                            (0, Batch.decode(opts.batch, opts.context))):
            simulated = sim_step.simulate_step(model, plan, batch, load_profile(profile),
                                               placement=placement, trace=True)
            for rank in range(2):
                for stream in ("compute", "comm"):
                    # both keep their events in issue order
                    ran = [e.op_id for e in measured["trace_events"]
                           if e.rank == rank and e.args["step"] == step and e.stream == stream]
                    sim = [e.op_id for e in simulated.events
                           if e.rank == rank and e.stream == stream]
                    assert ran and ran == sim, (opts.model, opts.dbo, step, rank, stream)
    return runs


def test_runtime_and_simulator_issue_the_same_ops_in_the_same_order():
    base = RunOptions(model="tiny-deepseek", world_size=2, batch=4, context=8, steps=1,
                      trace=True, prefill=True)
    assert_same_issue_order([base, base.with_(dbo=True, unfused=True)], "mi300x")


def test_runtime_and_simulator_issue_the_same_ops_for_each_family():
    """The op graph is the contract: the runtime's trace and the simulator's of each family's
    tiny model (prefill, then decode; DBO and the unfused graph for one) carry the same op ids
    in the same order on every rank and stream, the indexer and the q/k norm included."""
    base = RunOptions(model="tiny-deepseek-v32", world_size=2, batch=4, context=8, steps=1,
                      trace=True, prefill=True)
    grid = [base, base.with_(model="tiny-glm4-moe", dbo=True, unfused=True),
            base.with_(model="tiny-llama4")]
    kinds = set()
    for opts, measured in zip(grid, assert_same_issue_order(grid, "h200"), strict=True):
        kinds |= {e.kind for e in measured["trace_events"]}
        names = {e.op_id.split(".mb")[0] for e in measured["trace_events"]}
        if opts.model == "tiny-glm4-moe":
            assert {"L0.attn.qk_norm", "L0.attn.rope"} <= names
        if opts.model == "tiny-llama4":  # Scout's norm on the RoPE layers, not layer 3
            assert "L0.attn.qk_l2_norm" in names and "L3.attn.qk_l2_norm" not in names
    assert {"indexer", "attention_prefill", "attention_decode", "rope"} <= kinds
