"""epsim's runtime: the op graph executed for real with torch (docs/design.md section 2.4).

Requires torch (the ``runtime`` extra) in the rank processes; this package's top level and
``epsim.runtime.launch``/``epsim.runtime.options`` import it lazily, so a launching parent process stays light.
Depends on ``model`` only, never on ``sim``.

    runtime.options    RunOptions and validation (model, plan, placement)
    runtime.weights    random weights with a fixed seed, identical on every rank
    runtime.kernels    the math of each op kind (MLA decode, routing, fused MoE, ...)
    runtime.kv_cache   MLA's latent KV cache (bf16 or FP8 storage)
    runtime.ops        OP_IMPLS: the implementation of each op kind (the runtime's contract half),
                       typed against RankView, what an op reads of its rank
    runtime.comm       EP dispatch/combine over all_to_all_single (dynamic and static), the
                       Exchange protocol a rank's ops call
    runtime.backends   optional aiter fused_moe and MORI-EP backends; picks each rank's MoE
                       backend and exchange once
    runtime.executor   RankRuntime: walks the shared schedule, times every op (RankStepOutput)
    runtime.capture    CUDA/HIP graph capture of the static decode step
    runtime.reference  the dense single-process reference for --check
    runtime.launch     local rank spawning, torchrun, fault handling
    runtime.summary    per-step records and rank 0's summary of a run (and its --check)
    runtime.lifecycle  local ranks tied to the parent: process group, parent-death signal,
                       heartbeats, progress, SIGTERM handling, run folders (also calibrate.comm_bench's)
"""

from .launch import launch_local, run_rank, under_torchrun
from .options import RunOptions, validate

__all__ = ["RunOptions", "launch_local", "run_rank", "under_torchrun", "validate"]
