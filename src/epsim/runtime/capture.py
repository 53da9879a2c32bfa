"""CUDA/HIP graph capture of the static-shape decode step.

The step is recorded once (``torch.cuda.CUDAGraph``) and replayed: one launch per step instead of
one per kernel. Capture needs what the reference deployment's HIP graphs need: static shapes (the
static dispatch/combine with a fixed capacity per rank, the masked MoE backend, attention over the
whole cache buffer with the valid lengths as a tensor) and no host reads inside the step. The
state the step advances (lengths, next input tokens) is updated in place, so each replay decodes
the next token. NCCL/RCCL collectives are captured inside the graph.

On the CPU there is nothing to capture: ``epsim.runtime.options.validate`` refuses ``capture`` with a
one-line error. This path has not been run on a GPU in this project yet (docs/runtime.md);
``bench/gpu_decode_step.py`` is the script that exercises it.
"""

from __future__ import annotations

import time

import torch

from epsim.model.trace import TraceEvent

from .executor import RankRuntime, RankStepOutput


class CapturedDecode:
    """Capture a rank's decode step after one eager warm-up step, then replay it.

    ``first()`` runs step 0 eagerly (on a side stream, as capture requires, and traced per op)
    and records step 1; ``replay()`` runs each further step.
    """

    def __init__(self, rt: RankRuntime) -> None:
        if rt.device.type != "cuda":
            raise RuntimeError("graph capture needs a CUDA/ROCm device")
        if not rt.static:
            raise RuntimeError("graph capture needs the static-shape step (--static)")
        self.rt = rt
        self.graph = torch.cuda.CUDAGraph()
        self.out: RankStepOutput | None = None

    def first(self) -> RankStepOutput:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = self.rt.step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        done = self.rt.steps_done
        with torch.cuda.graph(self.graph):
            self.out = self.rt.step(capturing=True)
        self.rt.steps_done = done  # recording executed nothing
        return warm

    def replay(self) -> RankStepOutput:
        assert self.out is not None, "call first() before replay()"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.graph.replay()
        torch.cuda.synchronize()
        step_us = (time.perf_counter() - t0) * 1e6
        self.rt.steps_done += 1
        event = TraceEvent("decode_step.graph", "graph", self.rt.rank, "compute", 0.0, step_us,
                           -1, 0, {"captured": True})
        return RankStepOutput(self.out.logits.clone(), self.out.next_tokens.clone(),
                          self.out.hidden.clone(), step_us, [event])
