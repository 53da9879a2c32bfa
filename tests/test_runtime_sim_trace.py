"""The runtime and the simulator run the same op graph: their traces of one configuration have
the same op ids on every rank (docs/design.md section 2.1: an op only one of them knows is a bug)."""

import pytest

pytest.importorskip("torch")
sim_step = pytest.importorskip("epsim.sim.step")  # the simulator's step (lands on main separately)

from epsim.model.graph import Batch  # noqa: E402
from epsim.runtime import RunOptions, launch_local, validate  # noqa: E402
from epsim.sim.hardware import load_profile  # noqa: E402


def test_runtime_and_simulator_traces_share_op_ids():
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
                ran = sorted(e.op_id for e in measured["trace_events"]
                             if e.rank == rank and e.args["step"] == step)
                sim = sorted(e.op_id for e in simulated.events
                             if e.rank == rank and e.stream != "host")
                assert ran and ran == sim, (opts.dbo, step, rank)
