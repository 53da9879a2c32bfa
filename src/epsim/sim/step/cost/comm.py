"""The communication family: ``dispatch`` / ``combine`` (the EP exchanges), ``all_reduce``,
``all_gather``.

A collective takes a fixed latency plus the slowest link's bytes over its usable bandwidth
(``collective_time``): per peer link on a full mesh (xGMI), per GPU egress/ingress through a
switch (NVLink), per GPU egress/ingress through the NIC for peers on another node. Not a compute
roofline: no per-kind ``calibrated`` figures.

Table features (``kernel_tables.FEATURES``): ``dispatch`` / ``combine``: ``tokens`` per rank,
``ranks``, ``hidden``. Under sampled routing ``tokens`` is the rank count that, uniformly routed,
would load the busiest link as much as this step's routing does. A table naming an exchange
``mode`` (``sim.hardware.a2a``) times only the steps that run in that mode. ``all_reduce`` /
``all_gather``: ``bytes`` (the buffer), ``ranks``. A collective's table is chosen by whether its
group spans nodes (its scope: ``intra`` / ``inter``).

``times(ops, ctx)`` costs many collectives at once under their nominal traffic (one
``collective_time`` call per kind and group); one op's time is ``times`` at ``[op]``
(``KindCosting.seconds``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from epsim.model.opgraph import Op
from epsim.sim.hardware import a2a
from epsim.sim.hardware.a2a import A2AMode
from epsim.sim.hardware.profile import HardwareProfile

from .context import CostContext
from .roofline import KindCosting, eff

KINDS = ("dispatch", "combine", "all_reduce", "all_gather")

EXCHANGE_KEYS = ("fabric", "nic_bandwidth_per_gpu", "efficiency.link_bandwidth_usable",
                 "efficiency.nic_bandwidth_usable", "efficiency.a2a_latency_s")
COLLECTIVE_KEYS = ("fabric", "efficiency.link_bandwidth_usable",
                   "efficiency.collective_latency_s", "efficiency.collective_latency_graph_s")


def scope_of(nodes: np.ndarray | None) -> str:
    """A group's scope: ``"inter"`` where its members (their nodes) span nodes, else
    ``"intra"`` (None: one node)."""
    return "inter" if nodes is not None and len(set(np.asarray(nodes).tolist())) > 1 else "intra"


def collective_latency(kind: str, profile: HardwareProfile, captured: bool,
                       group_size: int = 1) -> float:
    """The fixed cost of one collective kernel in a group of ``group_size`` members."""
    e = eff(profile)
    if kind in ("dispatch", "combine"):
        return e.a2a_latency(kind, group_size)
    return e.collective_latency_graph_s if captured else e.collective_latency_s


def collective_time(kind: str, traffic: np.ndarray, profile: HardwareProfile,
                    nodes: np.ndarray, captured: bool) -> np.ndarray:
    """Seconds from a collective's start until its slowest link has delivered.

    Args:
        kind: dispatch, combine, all_reduce or all_gather (sets the latency).
        traffic: ``[..., n, n]`` bytes from group member ``s`` to member ``d`` (diagonal ignored).
        profile: the hardware.
        nodes: ``[n]`` node of each member; bytes between different nodes go through the NICs.
        captured: inside a captured graph (small collectives are cheaper there).

    Returns:
        ``[...]`` seconds.
    """
    e = eff(profile)
    traffic = np.asarray(traffic, dtype=np.float64)
    n = traffic.shape[-1]
    nodes = np.asarray(nodes)
    same = nodes[:, None] == nodes[None, :]
    off_diag = ~np.eye(n, dtype=bool)
    intra = np.where(same & off_diag, traffic, 0.0)
    if profile.fabric.topology == "full_mesh":
        # one link per peer: the most loaded link binds
        t_intra = intra.max(axis=(-2, -1)) / e.link_bandwidth_usable
    else:  # switch: any pattern at the per-GPU bandwidth; the busiest GPU port binds
        port = np.maximum(intra.sum(axis=-1).max(axis=-1), intra.sum(axis=-2).max(axis=-1))
        t_intra = port / e.link_bandwidth_usable
    if same.all():  # one node: no byte crosses a NIC (and summing the zeros costs a lot)
        t_inter = 0.0
    else:
        inter = np.where(~same, traffic, 0.0)
        nic = np.maximum(inter.sum(axis=-1).max(axis=-1), inter.sum(axis=-2).max(axis=-1))
        t_inter = nic / e.nic_bandwidth_usable
    return collective_latency(kind, profile, captured, n) + np.maximum(t_intra, t_inter)


def times(ops: Sequence[Op], ctx: CostContext) -> np.ndarray:
    """``[ops]`` seconds of each collective under its nominal (uniform) per-peer bytes: its
    group on ``ctx.members(op)`` (one node without), ``ctx.captured``'s latency, an EP exchange
    in ``ctx.mode`` (node-then-GPU traffic under a hierarchical one). Ops of one kind and group
    size are stacked into one ``collective_time`` call; one op's time is ``times`` at ``[op]``."""
    out = np.zeros(len(ops))
    stacks: dict[tuple, tuple[np.ndarray, list[int], list[np.ndarray]]] = {}
    for i, op in enumerate(ops):
        members = ctx.members(op)
        if members is None:
            members = np.zeros(len(op.peer_bytes), dtype=np.int64)
        members = members[:len(op.peer_bytes)]
        _, rows, traffic = stacks.setdefault((op.kind, members.tobytes()), (members, [], []))
        rows.append(i)
        traffic.append(_nominal_traffic(op, members, ctx.mode))
    for (kind, _), (members, rows, traffic) in stacks.items():
        out[rows] = collective_time(kind, np.stack(traffic), ctx.profile, members, ctx.captured)
    return out


def _nominal_traffic(op: Op, members: np.ndarray, mode: A2AMode | None) -> np.ndarray:
    """``[n, n]`` bytes between the members of ``op``'s group under uniform routing."""
    peers = np.asarray(op.peer_bytes, dtype=np.float64)
    layout = a2a.node_layout(members) if mode is not None and mode.hierarchical else None
    if layout is not None and op.kind in COSTING and COSTING[op.kind].exchange:
        d = op.dims
        tokens, node_tokens = a2a.uniform_tokens(d["expected_tokens_per_peer"], d["tokens"],
                                                 d["top_k"], len(peers), layout[1])
        return a2a.link_traffic(op.kind, mode, tokens, members,
                                lambda: node_tokens) * d["bytes_per_token"]
    return np.tile(peers, (len(peers), 1))


def nominal_collective(op: Op, profile: HardwareProfile, nodes: np.ndarray,
                       captured: bool, mode: A2AMode | None = None) -> float:
    """The roofline of one collective under its nominal (uniform) per-peer bytes (``times`` at
    ``[op]``); ``nodes``: the node of each member (the first ``group_size`` entries are used);
    ``mode``: an EP exchange's (``sim.hardware.a2a``)."""
    ctx = CostContext(profile, captured=captured, mode=mode,
                      nodes=tuple(np.asarray(nodes).tolist()))
    return float(times([op], ctx)[0])


# --------------------------------------------------------------------------------------------
# Table features, and the roofline at other features
# --------------------------------------------------------------------------------------------


def _exchange_features(op: Op, top_k: int | None) -> dict[str, float]:
    d = op.dims
    return {"tokens": d["tokens"], "ranks": d["group_size"], "hidden": d["hidden"]}


def _collective_features(op: Op, top_k: int | None) -> dict[str, float]:
    return {"bytes": op.bytes_read, "ranks": op.dims["group_size"]}


def _uniform_collective(kind: str, profile: HardwareProfile, ranks: int, per_peer: np.ndarray,
                        inter: bool, captured: bool) -> np.ndarray:
    """A collective moving ``per_peer`` bytes between every pair of ``ranks`` members."""
    nodes = np.zeros(ranks, dtype=np.int64)
    if inter:
        gpn = profile.gpus_per_node
        nodes = np.arange(ranks) // gpn if ranks > gpn else np.arange(ranks)
    unit = np.ones((ranks, ranks))
    lat = collective_latency(kind, profile, captured, ranks)
    per_byte = float(collective_time(kind, unit, profile, nodes, captured)) - lat
    return lat + per_byte * per_peer


def _exchange_peer_bytes(op: Op, f: dict[str, np.ndarray], rows: np.ndarray,
                         ranks: int) -> np.ndarray:
    """Bytes to each peer at ``rows``: the op's per-peer hit rate, rescaled by how likely a
    token's ``top_k`` experts reach a peer among ``ranks`` rather than the op's group."""
    d = op.dims
    k = float(d.get("top_k", 1))
    hit0 = d["expected_tokens_per_peer"] / max(d["tokens"], 1e-30)
    reach = 1.0 - (1.0 - 1.0 / ranks) ** k if ranks > 1 else 1.0
    reach0 = 1.0 - (1.0 - 1.0 / d["group_size"]) ** k if d["group_size"] > 1 else 1.0
    row_bytes = d["bytes_per_token"] * f["hidden"][rows] / d["hidden"]
    return f["tokens"][rows] * hit0 * reach / reach0 * row_bytes


def _all_reduce_peer_bytes(op: Op, f: dict[str, np.ndarray], rows: np.ndarray,
                           ranks: int) -> np.ndarray:
    return 2.0 * f["bytes"][rows] / ranks  # reduce-scatter then all-gather of 1 / ranks each


def _all_gather_peer_bytes(op: Op, f: dict[str, np.ndarray], rows: np.ndarray,
                           ranks: int) -> np.ndarray:
    return f["bytes"][rows]


def _collective_roofline(peer_bytes: Callable[[Op, dict[str, np.ndarray], np.ndarray, int],
                                              np.ndarray],
                         op: Op, ctx: CostContext, f: dict[str, np.ndarray]) -> np.ndarray:
    """A collective's roofline, uniform traffic of ``peer_bytes(op, f, rows, ranks)`` per peer;
    rows grouped by their ``ranks`` (the group's layout, latency and busiest link follow it;
    its nodes: spread over nodes where ``op``'s group spans them in ``ctx``)."""
    profile, captured = ctx.profile, ctx.captured
    inter = scope_of(ctx.members(op)) == "inter"
    out = np.zeros(len(f["ranks"]))
    for r in np.unique(f["ranks"]):
        rows = f["ranks"] == r
        ranks = int(r)
        out[rows] = _uniform_collective(op.kind, profile, ranks, peer_bytes(op, f, rows, ranks),
                                        inter, captured)
    return out


_EXCHANGE = KindCosting("comm", times, EXCHANGE_KEYS, features=_exchange_features,
                        roofline_at=partial(_collective_roofline, _exchange_peer_bytes),
                        scoped=True, exchange=True, collective=True)

#: op kind -> how it is costed (the two exchanges share one entry)
COSTING: dict[str, KindCosting] = {
    "dispatch": _EXCHANGE,
    "combine": _EXCHANGE,
    "all_reduce": KindCosting("comm", times, COLLECTIVE_KEYS,
                              features=_collective_features,
                              roofline_at=partial(_collective_roofline, _all_reduce_peer_bytes),
                              scoped=True, collective=True),
    "all_gather": KindCosting("comm", times, COLLECTIVE_KEYS,
                              features=_collective_features,
                              roofline_at=partial(_collective_roofline, _all_gather_peer_bytes),
                              scoped=True, collective=True),
}
