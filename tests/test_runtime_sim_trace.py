"""The runtime and the simulator run the same op graph in the same order: their traces of one
configuration issue the same op ids in the same sequence on every rank and stream (docs/design.md
section 2.1: an op only one of them knows, or one issued out of turn, is a bug)."""

import pytest

pytest.importorskip("torch")

from epsim.model.opgraph import Batch  # noqa: E402
from epsim.runtime import RunOptions, launch_local, validate  # noqa: E402
from epsim.sim.hardware.profile import load_profile  # noqa: E402
from epsim.sim.step import simulate as sim_step  # noqa: E402


def test_runtime_and_simulator_issue_the_same_ops_in_the_same_order():
    base = RunOptions(model="tiny-deepseek", world_size=2, batch=4, context=8, steps=1,
                      trace=True, prefill=True)
    grid = [base, base.with_(dbo=True, unfused=True)]
    for opts, measured in zip(grid, launch_local(grid, 2), strict=True):
        model, plan, placement = validate(opts)
        # step -1 is the prefill of context - 1 prompt tokens, step 0 the decode step
        for step, batch in ((-1, Batch.prefill(opts.batch, opts.context - 1)),
                            (0, Batch.decode(opts.batch, opts.context))):
            simulated = sim_step.simulate_step(model, plan, batch, load_profile("mi300x"),
                                               placement=placement, trace=True)
            for rank in range(2):
                for stream in ("compute", "comm"):
                    # both keep their events in issue order
                    ran = [e.op_id for e in measured["trace_events"]
                           if e.rank == rank and e.args["step"] == step and e.stream == stream]
                    sim = [e.op_id for e in simulated.events
                           if e.rank == rank and e.stream == stream]
                    assert ran and ran == sim, (opts.dbo, step, rank, stream)
