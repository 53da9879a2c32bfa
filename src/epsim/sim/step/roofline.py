"""The cost model: how long one op takes on one GPU under a hardware profile.

Every compute op is a roofline with achievable (not peak) figures from the profile's
``efficiency`` tables:

    time = max(flops_done / (peak_flops[dtype] * gemm_flops_fraction[dtype]),
               bytes / (hbm_bandwidth * hbm_fraction)) / occupancy

* GEMMs pay for whole matrix-core tiles: a GEMM of ``M`` rows computes ``ceil(M / tile) * tile``
  rows (``gemm_tile_m``). At decode's skinny ``M`` the weight bytes dominate and the op is
  memory-bound at the achievable HBM bandwidth: no separate "small-M efficiency" constant.
* A grouped (fused-MoE) GEMM reads the weights of the experts that received tokens and pays the
  tile padding per expert (``grouped_gemm_time`` takes the per-expert counts of this step).
* Decode attention is the same roofline (its math runs as matrix ops in the KV cache's dtype: FP8
  with an FP8 cache, as aiter's FP8 MLA decode kernel does, else BF16; the FP8 cache also halves the
  bytes), its compute roof the published decode kernel's achieved rate where the profile has one
  (``attention_decode_flops``), times a wave-quantisation occupancy: ``seqs * ceil(context / attention_split_tokens)``
  work items fill ``ceil(items / CUs)`` waves of the GPU's CUs.
* Collectives (``collective_time``): a fixed latency plus the slowest link's bytes over its usable
  bandwidth: per peer link on a full mesh (xGMI), per GPU egress/ingress through a switch (NVLink),
  per GPU egress/ingress through the NIC for peers on another node.

Profiles fitted by ``epsim calibrate`` add, per compute op kind, a fixed overhead that is not
overlapped and a factor on the roofline (``efficiency.op_overhead_s`` / ``op_time_scale``:
``time = overhead[kind] + scale[kind] * roofline``); a CPU profile (``efficiency.roofline =
"sum"``: one core computes and moves bytes in turn) adds the two terms instead, each with its own
factor (``overhead + scale * flops / F + bytes_scale * bytes / B``); and a per-peer all-to-all
latency. Shipped GPU profiles have none of these, so their times are the plain roofline.

Profiles fitted to measured runs (``epsim calibrate --from-bench``) carry
``efficiency.op_final_scale``: a factor per op class, kind or group on the op's *final* time,
whatever timed it (a kernel table or this roofline; :func:`final_scaled`, applied once per op by
``op_cost.op_time`` and by ``op_cost``'s timers), before the kernel floors
(``sim.step.kernels.floored``) hold it at least the device's smallest kernel time.

Measured kernel tables: where the profile's selected kernel set (``HardwareProfile.kernel_set``)
has a table for an op, ``op_time`` takes the table's time (``epsim.sim.step.op_cost``); this
roofline is the fallback, and without a kernel set the only model.

Launch costs (per-kernel CPU launch, graph replay) are the executor's business (:mod:`sim.step.executor`).
Cost functions are registered per op kind in ``COST_MODELS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from epsim.model.errors import EpsimError
from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import Efficiency, HardwareProfile


def _eff(profile: HardwareProfile) -> Efficiency:
    return profile.require_efficiency()


def achievable_flops(profile: HardwareProfile, dtype: str) -> float:
    """Achievable FLOP/s of a large GEMM in ``dtype``."""
    compute = "bf16" if dtype.startswith("fp8_") else dtype
    return profile.peak(compute) * _eff(profile).gemm_fraction(compute)


def achievable_bandwidth(profile: HardwareProfile) -> float:
    """Achievable HBM bytes/s."""
    return profile.hbm_bandwidth * _eff(profile).hbm_fraction


def roofline(profile: HardwareProfile, flops: float, bytes_moved: float, dtype: str,
             kind: str | None = None) -> float:
    """Seconds for ``flops`` in ``dtype`` and ``bytes_moved`` of HBM traffic, whichever binds;
    under ``efficiency.roofline == "sum"`` (a CPU core does both in turn) the two terms add, each
    with ``kind``'s factor (``op_time_scale`` / ``op_bytes_scale``)."""
    t_flops = flops / achievable_flops(profile, dtype)
    t_bytes = bytes_moved / achievable_bandwidth(profile)
    e = _eff(profile)
    if e.roofline == "sum" and kind is not None:
        return e.scale(kind) * t_flops + e.bytes_scale(kind) * t_bytes
    return max(t_flops, t_bytes)


def padded_rows(m: float, tile: int) -> float:
    """Rows a GEMM of ``m`` rows computes on ``tile``-row matrix-core tiles."""
    return math.ceil(m / tile) * tile if m > 0 else 0.0


def op_class(op: Op) -> str:
    """The key of an op's fitted per-kind figures: its kind, or ``gemm.batched`` for a batched
    GEMM (MLA's per-head absorption: another kernel family; falls back to ``gemm``)."""
    if op.kind == "gemm" and op.dims.get("batch", 1) > 1:
        return "gemm.batched"
    return op.kind


def gemm_time(op: Op, profile: HardwareProfile) -> float:
    d = op.dims
    tile = _eff(profile).gemm_tile_m
    flops = op.flops * padded_rows(d["m"], tile) / d["m"] if d["m"] else 0.0
    return roofline(profile, flops, op.bytes, op.dtype, op_class(op))


def attention_occupancy(profile: HardwareProfile, seqs: int, context: int) -> float:
    """Share of the CUs busy on average: ``items / (waves * CUs)`` for the split-KV work items."""
    split = _eff(profile).attention_split_tokens
    items = seqs * math.ceil(context / split)
    cus = profile.compute_units
    return items / (math.ceil(items / cus) * cus)


def attention_math_dtype(op: Op) -> str:
    """FP8 KV cache: the kernel runs FP8 matrix ops (aiter's FP8 MLA decode quantises the query
    to FP8); a BF16 cache: BF16 matrix ops."""
    return "fp8" if op.dims.get("kv_dtype") == "fp8" else "bf16"


def attention_decode_time(op: Op, profile: HardwareProfile) -> float:
    d = op.dims
    # DSA's sparse decode splits the keys it gathers (``keys``), not the whole context
    occ = attention_occupancy(profile, int(d["seqs"]), int(d.get("keys", d["context"])))
    kernel_rate = _eff(profile).attention_decode_flops.get(str(d.get("kv_dtype")))
    if kernel_rate is None:
        return roofline(profile, op.flops, op.bytes, attention_math_dtype(op), op.kind) / occ
    # a published decode kernel's achieved rate replaces the GEMM's as the compute roof
    return max(op.flops / kernel_rate, op.bytes / achievable_bandwidth(profile)) / occ


def attention_prefill_time(op: Op, profile: HardwareProfile) -> float:
    return roofline(profile, op.flops, op.bytes, attention_math_dtype(op), op.kind)


def indexer_time(op: Op, profile: HardwareProfile) -> float:
    """DSA's lightning indexer: no kernel table measures it, so a roofline on the FP8 matrix
    rate (DeepGEMM's ``fp8_mqa_logits`` scores in FP8) and HBM, its FLOPs and bytes the graph's
    (``epsim.model.attention_keys.indexer_cost``)."""
    dtype = op.dtype if op.dtype in profile.peak_flops else "bf16"
    return roofline(profile, op.flops, op.bytes, dtype, op.kind)


def streaming_time(op: Op, profile: HardwareProfile) -> float:
    """Norms, RoPE, activations, embedding, router, LM head, sampling: a plain roofline."""
    dtype = op.dtype if op.dtype in profile.peak_flops else "bf16"
    return roofline(profile, op.flops, op.bytes, dtype, op.kind)


def grouped_gemm_nominal(op: Op, profile: HardwareProfile) -> float:
    """The fused-MoE op under the graph's nominal (uniform) routing."""
    d = op.dims
    experts = float(d["active_experts"])
    # one representative expert with the mean count, counted ``experts`` times
    per_expert = np.full(1, d["pairs"] / experts if experts else 0.0)
    return float(grouped_gemm_time(op, profile, per_expert, scale_experts=experts))


def grouped_gemm_time(op: Op, profile: HardwareProfile, expert_pairs: np.ndarray,
                      scale_experts: float = 1.0) -> np.ndarray:
    """A grouped GEMM (fused MoE) over this step's per-expert pair counts.

    Args:
        op: the graph's grouped_gemm op (its FLOPs and bytes per pair and per expert are used).
        profile: the hardware.
        expert_pairs: ``[..., experts]`` pairs each local expert received.
        scale_experts: internal (nominal routing: one representative expert counted this often).

    Returns:
        ``[...]`` seconds.
    """
    d = op.dims
    tile = _eff(profile).gemm_tile_m
    # a shared expert run inside the kernel (Fusion.shared_expert_in_moe) is one more local
    # expert with the rank's own rows: its pairs do not depend on the routing
    shared = int(d.get("shared_experts", 0))
    shared_pairs = float(d.get("shared_pairs", 0.0))
    pairs_nominal = float(d["pairs"]) + shared_pairs
    active_nominal = float(d["active_experts"]) + shared
    flops_per_pair = op.flops / pairs_nominal if pairs_nominal else 0.0
    weight_per_expert = op.weight_bytes / active_nominal if active_nominal else 0.0
    act_per_pair = (op.bytes - op.weight_bytes) / pairs_nominal if pairs_nominal else 0.0
    counts = np.asarray(expert_pairs, dtype=np.float64)
    padded = np.ceil(counts / tile) * tile
    flops = flops_per_pair * padded.sum(axis=-1) * scale_experts
    active = (counts > 0).sum(axis=-1) * scale_experts
    moved = weight_per_expert * active + act_per_pair * counts.sum(axis=-1) * scale_experts
    if shared and shared_pairs:
        per_shared = np.ceil(shared_pairs / shared / tile) * tile
        flops = flops + flops_per_pair * per_shared * shared
        moved = moved + weight_per_expert * shared + act_per_pair * shared_pairs
    t_flops = flops / achievable_flops(profile, op.dtype)
    t_bytes = moved / achievable_bandwidth(profile)
    e = _eff(profile)
    if e.roofline == "sum":
        return e.scale(op.kind) * t_flops + e.bytes_scale(op.kind) * t_bytes
    return np.maximum(t_flops, t_bytes)


def _collective_nominal(op: Op, profile: HardwareProfile) -> float:
    """A collective under the graph's nominal per-peer bytes (uniform routing), eager latency."""
    peers = np.asarray(op.peer_bytes, dtype=np.float64)
    n = len(peers)
    traffic = np.tile(peers, (n, 1))
    return float(collective_time(op.kind, traffic, profile, np.zeros(n, dtype=np.int64),
                                 captured=False))


#: op kind -> (op, profile) -> seconds (nominal routing for grouped GEMMs and collectives)
COST_MODELS: dict[str, Callable[[Op, HardwareProfile], float]] = {
    "gemm": gemm_time,
    "grouped_gemm": grouped_gemm_nominal,
    "attention_decode": attention_decode_time,
    "attention_prefill": attention_prefill_time,
    "norm": streaming_time,
    "rope": streaming_time,
    "router": streaming_time,
    "elementwise": streaming_time,
    "embedding": streaming_time,
    "lm_head": streaming_time,
    "sample": streaming_time,
    "dispatch": _collective_nominal,
    "combine": _collective_nominal,
    "all_reduce": _collective_nominal,
    "all_gather": _collective_nominal,
    "indexer": indexer_time,
}


def calibrated(kind: str, seconds: float | np.ndarray, profile: HardwareProfile
               ) -> float | np.ndarray:
    """A compute op's cost-model ``seconds`` with the profile's per-kind overhead and factor
    (identity for profiles without them)."""
    e = _eff(profile)
    if e.roofline == "sum":  # the per-kind factors are inside the roofline's two terms
        return e.overhead(kind) + seconds
    return e.overhead(kind) + e.scale(kind) * seconds


def final_scaled(op: Op, profile: HardwareProfile, seconds):
    """``seconds`` (an op's final time, any shape) times the profile's fitted
    ``op_final_scale`` factor of the op's class; unchanged without one (no shipped profile has
    any)."""
    e = profile.efficiency
    if e is None or not e.op_final_scale:
        return seconds
    return seconds * e.final_scale(op_class(op))


def roofline_op_time(op: Op, profile: HardwareProfile) -> float:
    """Seconds one op takes on its own under the roofline of this module."""
    try:
        model = COST_MODELS[op.kind]
    except KeyError:
        raise EpsimError(f"no cost model for op kind {op.kind!r} ({op.id})") from None
    if op.is_collective:
        return model(op, profile)
    return float(calibrated(op_class(op), model(op, profile), profile))


def collective_latency(kind: str, profile: HardwareProfile, captured: bool,
                       group_size: int = 1) -> float:
    """The fixed cost of one collective kernel in a group of ``group_size`` members."""
    e = _eff(profile)
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
    e = _eff(profile)
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
