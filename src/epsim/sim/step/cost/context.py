"""What costing an op reads besides the op: ``CostContext``, built once per compiled step.

A step's ops are costed on one profile under one deployment: the model's top-k (a fused MoE
op's table features), whether the step runs inside a captured graph, its EP exchange mode and
MoE layout (which pick the tables deployed), and the node of each of its ranks (a collective's
group, its table scope and its busiest link). ``sim.step.compile`` builds one per compiled step
and passes it to every timer (``sim.step.cost.timing``) and family (``times(ops, ctx)``); an op
costed on its own (``op_time(op, profile)``) gets ``CostContext(profile)``: no top-k, eager, no
deployment, one node.

What a kind reads of it: the compute families the profile alone (and a table's ``top_k``); the
collectives the members' nodes (``members``), ``captured`` and, an EP exchange, ``mode``.
Selectors a kind's tables cannot carry (``kernel_tables.MODE_KINDS`` / ``LAYOUT_KINDS``) exclude
nothing, so one step-wide ``mode`` and ``layout`` serve every op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from epsim.model.opgraph import Op
from epsim.sim.hardware.a2a import A2AMode
from epsim.sim.hardware.profile import HardwareProfile


@dataclass(frozen=True)
class CostContext:
    """The step-wide facts an op's cost reads (module docstring).

    profile: the hardware (its selected kernel set included).
    top_k: the model's top-k (a fused MoE op whose dims lack it), None without MoE layers.
    captured: the step runs inside a captured graph (cheaper small collectives).
    mode: the EP exchange mode of the step (``sim.hardware.a2a``), None: not given.
    layout: the plan's MoE layout (``"ep"`` / ``"tp"``), ``""``: not given.
    nodes: the node of each rank of the step (an EP group's members, in rank order), None: one
        node (and no scope: ``intra`` tables). Example: ``(0, 0, 0, 0, 1, 1, 1, 1)``.
    tp: members of a collective outside the EP group (the first ``tp`` ranks); None: all of
        ``nodes``.
    """

    profile: HardwareProfile
    top_k: int | None = None
    captured: bool = False
    mode: A2AMode | None = None
    layout: str = ""
    nodes: tuple[int, ...] | None = None
    tp: int | None = None

    def members(self, op: Op) -> np.ndarray | None:
        """``[members]`` the node of each member of ``op``'s group (a collective's), None for a
        compute op or without ``nodes``."""
        if not op.is_collective or self.nodes is None:
            return None
        size = len(self.nodes) if op.dims.get("group") == "ep" or self.tp is None else self.tp
        return np.asarray(self.nodes[:size])

    def with_profile(self, profile: HardwareProfile) -> CostContext:
        """This context on ``profile`` (itself when it already is)."""
        return self if profile is self.profile else replace(self, profile=profile)


def as_context(where: CostContext | HardwareProfile) -> CostContext:
    """``where`` itself, or a profile's context for an op costed on its own."""
    return where if isinstance(where, CostContext) else CostContext(where)
