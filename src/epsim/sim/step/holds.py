"""How the host and the slowest rank stretch a step's EP exchanges (from the profile's
measurements; every GPU profile has none of the keys, and then only eager dispatch's count
exchange holds the host).

    host_holds       ``host_sync`` / ``host_release_s`` of a program: which exchanges hold the
                     issuing host, and for how long
    stragglers       each exchange's wait for the last rank (``exchange_straggler_fraction``)
    dispatch_holds   each exchange's issuing call's hold beyond its fixed part
                     (``a2a_host_block_fraction``)

The last two are a measured share of the compute issued since the previous exchange
(``_share_of_compute_since_exchange``), in issue order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epsim.model.opgraph import Op
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware.profile import HardwareProfile

from .cost.comm import collective_latency

#: the EP exchange kinds
EXCHANGES = ("dispatch", "combine")


def host_holds(ops: Sequence[Op], group_size: np.ndarray, profile: HardwareProfile,
               captured: bool, late: np.ndarray | None = None,
               hold: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``host_sync`` and ``host_release_s`` of the program: eager, the host waits for a
    dispatch's count exchange (a latency-bound exchange of its group) before it issues more; a
    profile that measured how long issuing each exchange holds the host
    (``a2a_host_block_by_group_s``, CPU runtimes) gives that instead, and a combine holds it too
    where measured (gloo's asynchronous call returns only once the rank's threads got a core).
    ``late``: the exchanges' stragglers (:func:`stragglers`): a dispatch's count exchange waits
    for the last rank, so its hold grows by the dispatch's; ``hold``: the same from the
    profile's measured hold share (:func:`dispatch_holds`)."""
    eff = profile.require_efficiency()
    sync = np.zeros(len(ops), dtype=bool)
    release = np.zeros(len(ops))
    if captured:
        return sync, release
    for i, op in enumerate(ops):
        if op.kind not in ("dispatch", "combine"):
            continue
        held = eff.host_block(op.kind, int(group_size[i]))
        if held is None and op.kind == "dispatch":
            held = collective_latency(op.kind, profile, captured, int(group_size[i]))
        if held is not None:
            sync[i], release[i] = True, held
            if late is not None and op.kind == "dispatch":
                release[i] += late[i]
            if hold is not None and op.kind == "dispatch":
                release[i] += hold[i]
    return sync, release


def dispatch_holds(ops: Sequence[Op], work: np.ndarray, profile: HardwareProfile,
                   plan: ParallelPlan) -> np.ndarray | None:
    """``[len(ops)]`` seconds each EP exchange's issuing call holds the host beyond its fixed
    part: ``a2a_host_block_fraction`` times the compute issued since the previous exchange
    (``host_holds`` applies it to dispatches). None without the key (every GPU profile) or
    without peers."""
    frac = profile.require_efficiency().host_block_fraction(
        min(plan.world_size, plan.gpus_per_node))
    return _share_of_compute_since_exchange(frac, ops, work, plan)


def stragglers(ops: Sequence[Op], work: np.ndarray, profile: HardwareProfile,
               plan: ParallelPlan) -> np.ndarray | None:
    """``[len(ops)]`` seconds each EP exchange waits for its last rank beyond the average one:
    ``exchange_straggler_fraction`` times the compute issued since the previous exchange (in
    issue order; ``work`` includes the ranks' sharing of the cores). None without the key
    (every GPU profile) or without peers."""
    frac = profile.require_efficiency().straggler_fraction(
        min(plan.world_size, plan.gpus_per_node))
    return _share_of_compute_since_exchange(frac, ops, work, plan)


def _share_of_compute_since_exchange(frac: float, ops: Sequence[Op], work: np.ndarray,
                                     plan: ParallelPlan) -> np.ndarray | None:
    """``[len(ops)]``: at each EP exchange ``frac`` times the compute ``work`` issued since the
    previous one (in issue order; 0 elsewhere); None when ``frac`` is 0 or there are no
    peers."""
    if frac <= 0.0 or plan.world_size < 2:
        return None
    out = np.zeros(len(ops))
    since = 0.0
    for i, op in enumerate(ops):
        if op.kind in EXCHANGES:
            out[i] = frac * since
            since = 0.0
        elif not op.is_collective:
            since += work[i]
    return out
