"""The issue order of a step's ops: data that the simulator and the runtime both walk.

As in SGLang's two-batch overlap ("operations strategy"), a layer's ops for one microbatch are cut
into *stages* at *yield points*; a yield point follows every collective (dispatch, combine,
all-reduce, all-gather), because that is where a microbatch would otherwise wait on the network.
The rank then issues stage 0 of microbatch 0, stage 0 of microbatch 1, stage 1 of microbatch 0, ...
so one microbatch's collective is in flight while the other computes. With one microbatch the
schedule is simply the ops in order.

Executors walk ``Schedule.slots`` in order. Within a slot, a compute op is issued on the compute
stream when its dependencies are done; a collective is issued on the communication engine and does
not block the compute stream (only the ops that depend on its result wait for it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One stage of one microbatch: the op ids a rank issues back to back, in order.

    microbatch: 0 or 1.
    op_ids: e.g. ``("L3.attn_norm.mb0", "L3.attn.q_a.mb0", ..., "L3.moe.dispatch.mb0")``.
    """

    microbatch: int
    op_ids: tuple[str, ...]


@dataclass(frozen=True)
class Schedule:
    """The whole step's issue order.

    microbatches: 1, or 2 under DBO.
    slots: the stages in issue order; a yield point separates consecutive slots.
    """

    microbatches: int
    slots: tuple[Slot, ...]

    def order(self) -> list[str]:
        """Every op id once, in issue order."""
        return [op_id for slot in self.slots for op_id in slot.op_ids]


def build_schedule(
    per_microbatch_blocks: Sequence[Sequence[Sequence[str]]],
    is_yield_point: Callable[[str], bool],
) -> Schedule:
    """Interleave microbatches stage by stage.

    Args:
        per_microbatch_blocks: ``[microbatch][block] -> op ids in order``; every microbatch has
            the same blocks (the embedding, each decoder layer, the head).
        is_yield_point: whether a microbatch yields right after issuing this op.

    Returns:
        A :class:`Schedule` whose slots, per block and stage, go microbatch 0, 1, 0, 1, ...
    """
    microbatches = len(per_microbatch_blocks)
    slots: list[Slot] = []
    for blocks in zip(*per_microbatch_blocks, strict=True):
        staged = [_cut(op_ids, is_yield_point) for op_ids in blocks]
        for stage in range(max(len(s) for s in staged)):
            for mb, stages in enumerate(staged):
                if stage < len(stages):
                    slots.append(Slot(microbatch=mb, op_ids=stages[stage]))
    return Schedule(microbatches=microbatches, slots=tuple(slots))


def _cut(op_ids: Sequence[str], is_yield_point: Callable[[str], bool]) -> list[tuple[str, ...]]:
    stages: list[tuple[str, ...]] = []
    current: list[str] = []
    for op_id in op_ids:
        current.append(op_id)
        if is_yield_point(op_id):
            stages.append(tuple(current))
            current = []
    if current:
        stages.append(tuple(current))
    return stages
