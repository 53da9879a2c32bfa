"""EP dispatch/combine communication modes: how an engine's all-to-all moves tokens.

Two kernel families run EP exchanges in the engines epsim models (DeepEP on NVIDIA, MORI-EP on
AMD), and the engine picks one per step:

* ``low_latency``: pure RDMA per target rank (DeepEP's "low-latency kernels with pure RDMA",
  MORI's ``*-LL`` kernels): every (token, destination GPU) copy is one message, intra-node peers
  over the node's fabric, the others over the NIC with no forwarding or de-duplication. After the
  messages are issued the kernel holds no compute units ("the all-to-all communication during
  decoding does not occupy GPU SMs: after RDMA messages are issued, all GPU SMs are freed",
  deepseek-ai/profile-data README.md @ 44960242, "Decoding"), so it charges no comm interference.
* ``normal`` (hierarchical, DeepEP's "normal kernels with NVLink and RDMA forwarding"): a token
  crosses the NIC once per destination node, to the GPU of the same local index there, which
  forwards it over the intra-node fabric to the GPUs holding its experts; the combine runs the same
  path backwards (reduced on the forwarding GPU, then one RDMA message per token and node). Its
  kernels run on the GPU's compute units throughout (DeepEP's ``num_sms``), so compute overlapping
  it slows by ``efficiency.comm_compute_slowdown``, as every collective did before modes existed.

``--a2a-mode auto`` resolves per step as SGLang's ``--deepep-mode auto`` does (``DeepEPMode.resolve``
in sgl-project/sglang ``python/sglang/srt/layers/moe/utils.py`` @ d737979c: normal when any DP
rank's batch has prefill ("extend") tokens, low_latency otherwise) when the EP group spans nodes.
Within one node SGLang's auto would still pick low_latency for decode; epsim's auto keeps
``normal`` there, an assumption of its own (no NIC traffic to de-duplicate; the intra-node
exchange charged as before modes existed, its kernel occupying compute units, which MORI's and
DeepEP's intra-node kernels do). ``--a2a-mode low_latency`` gives SGLang's choice in one node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from epsim.model.errors import EpsimError


@dataclass(frozen=True)
class A2AMode:
    """One kind of EP exchange kernel.

    name: ``"low_latency"`` or ``"normal"``; also the ``mode`` of the kernel tables that measure
        it (``epsim.sim.hardware.kernel_sets``; a table without a mode serves every mode).
    hierarchical: node-then-GPU traffic (one NIC crossing per destination node, forwarded over
        the intra-node fabric) instead of one message per destination GPU.
    occupies_cus: the kernel holds compute units while in flight (comm interference).
    """

    name: str
    hierarchical: bool
    occupies_cus: bool


A2A_MODES: dict[str, A2AMode] = {
    "low_latency": A2AMode("low_latency", hierarchical=False, occupies_cus=False),
    "normal": A2AMode("normal", hierarchical=True, occupies_cus=True),
}
AUTO = "auto"
#: the values ``--a2a-mode`` accepts
A2A_CHOICES: tuple[str, ...] = (AUTO, *A2A_MODES)
#: what ``auto`` resolves to, by (EP group spans nodes, the step's phase)
_AUTO: dict[tuple[bool, str], str] = {
    (False, "decode"): "normal", (False, "prefill"): "normal",
    (True, "decode"): "low_latency", (True, "prefill"): "normal",
}


def check_choice(choice: str) -> str:
    """``choice`` if ``--a2a-mode`` accepts it, else one line naming the choices."""
    if choice not in A2A_CHOICES:
        raise EpsimError(f"unknown a2a mode {choice!r}; choose one of {', '.join(A2A_CHOICES)}")
    return choice


def resolve(choice: str, phase: str, spans_nodes: bool) -> A2AMode:
    """The mode a step of ``phase`` runs its EP exchanges in under ``choice``."""
    check_choice(choice)
    name = _AUTO[(spans_nodes, phase)] if choice == AUTO else choice
    return A2A_MODES[name]


def with_prefill_choice(choice: str, spans_nodes: bool) -> str:
    """The choice a decode batch's exchanges take in a step where some rank prefills: the
    prefill's, on every rank (one all-to-all runs in one mode; SGLang OR-reduces
    ``is_extend_in_batch`` over the DP ranks before ``DeepEPMode.resolve``,
    sgl-project/sglang python/sglang/srt/layers/moe/utils.py @ d737979c). ``choice`` itself
    where the phases agree, so such steps share the decode batches' step models."""
    if choice != AUTO or resolve(AUTO, "decode", spans_nodes) == resolve(AUTO, "prefill",
                                                                         spans_nodes):
        return choice
    return resolve(AUTO, "prefill", spans_nodes).name


def spans_nodes(nodes: np.ndarray | None) -> bool:
    return nodes is not None and len(np.unique(np.asarray(nodes))) > 1


def node_layout(nodes: np.ndarray) -> tuple[int, int] | None:
    """``(nodes, gpus per node)`` when members are node-major in equal nodes (member ``r`` on
    node ``r // gpn``), the layout the same-index forwarding needs; else None."""
    nodes = np.asarray(nodes)
    m = int(nodes.max()) + 1 if nodes.size else 0
    if m < 2 or len(nodes) % m:
        return None
    gpn = len(nodes) // m
    return (m, gpn) if np.array_equal(nodes, np.arange(len(nodes)) // gpn) else None


def hierarchical_traffic(tokens: np.ndarray, node_tokens: np.ndarray, gpn: int) -> np.ndarray:
    """The per-link token rows of a node-then-GPU dispatch.

    Args:
        tokens: ``[..., n, n]`` token copies member ``s`` would send to member ``d`` directly
            (a token counted once per destination GPU).
        node_tokens: ``[..., n, m]`` tokens of member ``s`` with an expert on node ``b`` (a token
            counted once per destination node).
        gpn: members per node (``n = m * gpn``, node-major).

    Returns:
        ``[..., n, n]`` rows on each link: between nodes only ``(a, i) -> (b, i)`` carries, one
        row per token and destination node; inside node ``b``, ``(b, i) -> (b, j)`` carries the
        direct rows plus those it forwards for the remote members of local index ``i``. The
        combine's traffic is its transpose. Feed it to ``sim.step.cost.comm.collective_time``.
    """
    tokens = np.asarray(tokens, dtype=np.float64)
    n = tokens.shape[-1]
    m = n // gpn
    lead = tokens.shape[:-2]
    node = np.arange(n) // gpn
    same = node[:, None] == node[None, :]
    # rows reaching (b, j) from a remote (a, i), summed over a: forwarded by (b, i)
    remote = np.where(same, 0.0, tokens).reshape(*lead, m, gpn, m, gpn)
    fwd = remote.sum(axis=-4)  # [..., i, b, j]
    direct = tokens.reshape(*lead, m, gpn, m, gpn)
    nt = np.asarray(node_tokens, dtype=np.float64).reshape(*lead, m, gpn, m)
    out = np.zeros((*lead, m, gpn, m, gpn))
    idx = np.arange(gpn)
    for b in range(m):
        # between nodes: (a, i) -> (b, i) carries (a, i)'s tokens for node b, a != b
        out[..., :, idx, b, idx] = np.where((np.arange(m) != b)[:, None], nt[..., b], 0.0)
        out[..., b, :, b, :] = direct[..., b, :, b, :] + fwd[..., :, b, :]
    return out.reshape(*lead, n, n)


def uniform_tokens(per_peer: float, tokens: float, top_k: float, n: int, gpn: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [n, n], node_tokens [n, m])`` of a uniformly routed exchange: ``per_peer``
    rows to each member, and per node the tokens with any of their ``top_k`` experts there
    (``tokens * (1 - (1 - gpn / n) ** top_k)``: ``sim.step.routing``'s once-per-destination count)."""
    m = n // gpn
    node_hit = tokens * (1.0 - (1.0 - gpn / n) ** top_k) if tokens > 0 else 0.0
    return np.full((n, n), float(per_peer)), np.full((n, m), node_hit)


def link_traffic(kind: str, mode: A2AMode | None, tokens: np.ndarray, nodes: np.ndarray,
                 node_tokens: Callable[[], np.ndarray]) -> np.ndarray:
    """``[..., n, n]`` token rows on each link of a dispatch (``kind`` ``"dispatch"``) or of the
    combine that returns them (the transpose): ``tokens`` (``[..., n, n]`` rank -> GPU copies)
    as they are, or node-then-GPU (:func:`hierarchical_traffic`, ``node_tokens()``:
    ``[..., n, nodes]``) under a hierarchical mode when the members fill equal nodes."""
    layout = node_layout(nodes) if mode is not None and mode.hierarchical else None
    if layout is not None:
        tokens = hierarchical_traffic(tokens, node_tokens(), layout[1])
    return np.swapaxes(tokens, -1, -2) if kind == "combine" else tokens
