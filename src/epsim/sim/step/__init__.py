"""One forward step of every rank, simulated: ``simulate_step`` and its ``StepResult``.

    simulate.py     the entry point: compile, route, run the executor, report (``StepResult``)
    memo.py         ``StepMemo``: what the calls of one owner share (compiled steps, samples)
    compile.py      a plan's step compiled once: the op graph's structure, each batch costed on
                    it from one layer per class
    kernels.py      the kernel inventory's costs: each kernel's floor on the device, its
                    launch and framework dispatch on an eager host
    cost/           one op's seconds, one module per op-kind family (gemm, attention, comm,
                    elementwise), the one roofline (``roofline.py``), the kind registry
                    (``registry.py``), the kernel tables' timing (``timing.py``); its own face
                    (``sim.step.cost``) and README.md (how to add an op kind)
    routing.py      the step's expert routing sampled from load statistics
    routed.py       that routing applied to the compiled step: the fused MoE's and the
                    exchanges' times under it
    holds.py        how the host and the slowest rank stretch the EP exchanges
    executor/       the program both executors run and its semantics (``program.py``), the fast
                    (vectorised) executor and its numba walk (``walk.py``), the exact one (simpy,
                    ``exact.py``); its own face (``sim.step.executor``)

Uses ``epsim.sim.hardware`` and ``epsim.model``.
"""

from .memo import StepMemo
from .simulate import MODES, StepResult, simulate_step

__all__ = ["MODES", "StepMemo", "StepResult", "simulate_step"]
