"""What the kernel inventory (``epsim.sim.hardware.kernel_inventory``) costs a step: each kernel's
floor on the device and, outside a captured graph, its launch and framework dispatch on the host.

Rules (docs/simulator.md, "Kernel floors and eager launches"):

* a compute op of ``k`` kernels occupies its stream ``max(model, floor - node) + (k - 1) x
  floor`` (then the graph-node gap ``node``, as every op): the cost model (a measured table or
  the roofline) times the op's main kernel, which cannot finish faster than a kernel doing
  nothing; the other ``k - 1`` kernels are auxiliary ones (activation quantisation, sort/align,
  split-KV reduce, rotary, cache write) whose work the op's model does not count, each costing
  its floor. An op fused into a neighbour (``k = 0``) keeps its model time. Collectives are
  timed by their own latency figures (``collective_latency[_graph]_s``, the all-reduce tables).
* eager: the host issues each op in ``k x (kernel_launch_s + framework_dispatch_s)`` seconds
  (every kernel, compute or communication, is launched by one framework op call), running ahead
  of the GPU until a sync (``sim.step.executor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from epsim.model.opgraph import Op
from epsim.sim.hardware.kernel_inventory import INVENTORIES, NO_DEPLOYMENT, kernels_of
from epsim.sim.hardware.profile import HardwareProfile

__all__ = ["NO_DEPLOYMENT", "floored", "host_launch", "inventory_json", "kernel_count"]


def kernel_count(op: Op, profile: HardwareProfile,
                 deployment: tuple[str, str] = NO_DEPLOYMENT) -> int:
    """How many kernels the selected kernel set's engine launches for ``op`` in a step of
    ``deployment`` (MoE layout, exchange mode: the fused MoE's kernels follow the deployed
    grouped GEMM)."""
    return len(kernels_of(profile.kernel_set, op.kind, op.name, deployment))


def floored(seconds: Any, kernels: int, floor_s: float, node_s: float) -> Any:
    """A compute op's time on its stream, the graph-node gap aside (module docstring): the
    main kernel at least ``floor_s`` (measured launch to launch, so it holds the gap ``node_s``
    the caller adds), each other kernel ``floor_s``; ``kernels == 0``: fused, unchanged.
    ``seconds``: a number or an array (the routed fused MoE's per rank)."""
    if kernels == 0 or floor_s <= 0.0:
        return seconds
    if isinstance(seconds, np.ndarray):
        return np.maximum(seconds, floor_s - node_s) + (kernels - 1) * floor_s
    return max(seconds, floor_s - node_s) + (kernels - 1) * floor_s


def host_launch(ops: Sequence[Op], profile: HardwareProfile, captured: bool,
                deployment: tuple[str, str] = NO_DEPLOYMENT) -> np.ndarray:
    """``[n]`` host seconds to issue each op outside a graph (0 inside a captured graph)."""
    if captured:
        return np.zeros(len(ops))
    per_kernel = profile.kernel_launch_s + profile.require_efficiency().framework_dispatch_s
    return np.array([kernel_count(op, profile, deployment) * per_kernel for op in ops],
                    dtype=np.float64)


def inventory_json(ops: Sequence[Op], profile: HardwareProfile, captured: bool,
                   deployment: tuple[str, str] = NO_DEPLOYMENT) -> dict[str, Any]:
    """``--explain``'s kernel inventory: the set, where its list was read, the floor and host
    figures, and per op name of the step (issue order) its kind, kernels and count in the
    step. Example: ``{"ops": {"attn.q_b": {"kind": "gemm", "kernels": ["act_quant_fp8",
    "gemm_fp8"], "count": 61}}, ...}``."""
    eff = profile.require_efficiency()
    inv = INVENTORIES.get(profile.kernel_set)
    per_op: dict[str, dict[str, Any]] = {}
    for op in ops:
        entry = per_op.get(op.name)
        if entry is None:
            entry = per_op[op.name] = {
                "kind": op.kind, "kernels": list(kernels_of(profile.kernel_set, op.kind,
                                                            op.name, deployment)), "count": 0}
        entry["count"] += 1
    kernels = sum(len(e["kernels"]) * e["count"] for e in per_op.values())
    return {
        "kernel_set": profile.kernel_set,
        "engine": inv.engine if inv else "none (one kernel per op)",
        "source": inv.source if inv else "",
        "kernels_per_step": kernels,
        "kernel_floor_s": eff.kernel_floor_s,
        "graph_node_s": eff.graph_node_s,
        "kernel_launch_s": 0.0 if captured else profile.kernel_launch_s,
        "framework_dispatch_s": 0.0 if captured else eff.framework_dispatch_s,
        "ops": per_op,
    }
