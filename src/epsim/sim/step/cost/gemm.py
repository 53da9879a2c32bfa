"""The GEMM family: ``gemm``, ``grouped_gemm`` (fused MoE), ``lm_head``.

* GEMMs pay for whole matrix-core tiles: a GEMM of ``M`` rows computes ``ceil(M / tile) * tile``
  rows (``gemm_tile_m``). At decode's skinny ``M`` the weight bytes dominate and the op is
  memory-bound at the achievable HBM bandwidth: no separate "small-M efficiency" constant.
* A grouped (fused-MoE) GEMM reads the weights of the experts that received tokens and pays the
  tile padding per expert (``grouped_gemm_time`` takes the per-expert counts of this step; the
  nominal op one representative expert with the mean count).
* The LM head is a plain roofline on the op's dtype, read on the GEMM's figures.

``times(ops, ctx)`` costs many ops of these kinds at once from arrays of their FLOPs, bytes,
rates and tile padding; one op's time is ``times`` at ``[op]`` (``KindCosting.seconds``).

Table features (``kernel_tables.FEATURES``): ``gemm``: ``m, n, k, batch`` of its dims (a table
without ``batch``: plain GEMMs only); ``grouped_gemm`` (fused MoE only; the unfused gate/up and
down GEMMs stay on the roofline): ``tokens`` = the (token, expert) pairs the rank computes /
``top_k``, ``experts`` (local), ``top_k``, ``hidden``, ``inter``. Sampled routing sets each
rank's own ``tokens`` (the hottest rank's pairs set its time). When the graph runs the shared
expert inside the fused kernel (``Fusion.shared_expert_in_moe``: dims ``shared_experts``,
``shared_pairs``) ``experts`` and ``top_k`` are one more per shared expert (aiter's 33 experts,
top-9), and each rank's own tokens join its routed pairs. Its table is the deployment's
(``registry.DEPLOYED``): the one naming the step's exchange mode and the plan's MoE layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import HardwareProfile

from .context import CostContext
from .roofline import (
    COMPUTE_KEYS,
    KindCosting,
    eff,
    op_class,
    per_kind,
    roof_at,
    roof_rows,
    streaming_dtype,
)

KINDS = ("gemm", "grouped_gemm", "lm_head")


# --------------------------------------------------------------------------------------------
# The roofline at the ops
# --------------------------------------------------------------------------------------------


def times(ops: Sequence[Op], ctx: CostContext) -> np.ndarray:
    """``[ops]`` seconds of each op's roofline (any mix of the family's kinds; a grouped GEMM
    under nominal routing), before ``calibrated``: the family's one formula, an op's scalar time
    its value at ``[op]``."""
    return per_kind(ops, ctx, _FORMS)


def _gemm_times(ops: Sequence[Op], profile: HardwareProfile) -> np.ndarray:
    """Whole ``gemm_tile_m``-row tiles: ``ceil(m / tile) * tile`` rows of FLOPs (none at
    ``m = 0``)."""
    tile = eff(profile).gemm_tile_m
    m = np.array([op.dims["m"] for op in ops], dtype=np.float64)
    flops = np.array([op.flops for op in ops], dtype=np.float64)
    padded = np.where(m > 0, np.ceil(m / tile) * tile, 0.0)
    flops = np.where(m != 0, flops * padded / np.where(m != 0, m, 1.0), 0.0)
    return roof_rows(profile, flops, [op.bytes for op in ops], [op.dtype for op in ops],
                     [op_class(op) for op in ops])


def _lm_head_times(ops: Sequence[Op], profile: HardwareProfile) -> np.ndarray:
    return roof_rows(profile, [op.flops for op in ops], [op.bytes for op in ops],
                     [streaming_dtype(op, profile) for op in ops], [op.kind for op in ops])


def _grouped_nominal_times(ops: Sequence[Op], profile: HardwareProfile) -> np.ndarray:
    """The fused-MoE ops under the graph's nominal (uniform) routing: one representative
    expert with the mean count, counted ``active_experts`` times."""
    experts = np.array([float(op.dims["active_experts"]) for op in ops])
    pairs = np.array([op.dims["pairs"] for op in ops], dtype=np.float64)
    mean = np.where(experts != 0, pairs / np.where(experts != 0, experts, 1.0), 0.0)
    return _grouped_times(ops, profile, mean[:, None], experts)


def grouped_gemm_time(op: Op, profile: HardwareProfile, expert_pairs: np.ndarray) -> np.ndarray:
    """A grouped GEMM (fused MoE) over this step's per-expert pair counts.

    Args:
        op: the graph's grouped_gemm op (its FLOPs and bytes per pair and per expert are used).
        profile: the hardware.
        expert_pairs: ``[..., experts]`` pairs each local expert received.

    Returns:
        ``[...]`` seconds.
    """
    counts = np.asarray(expert_pairs, dtype=np.float64)
    return _grouped_times([op], profile, counts[None], np.ones(1))[0]


def _grouped_times(ops: Sequence[Op], profile: HardwareProfile, counts: np.ndarray,
                   scale_experts: np.ndarray) -> np.ndarray:
    """``[ops, ...]`` seconds of grouped GEMM ``ops[i]`` over ``counts[i]`` (``[ops, ...,
    experts]`` pairs per local expert), each expert's count ``scale_experts[i]`` times."""
    tile = eff(profile).gemm_tile_m
    # a shared expert run inside the kernel (Fusion.shared_expert_in_moe) is one more local
    # expert with the rank's own rows: its pairs do not depend on the routing
    c = np.array([_grouped_constants(op) for op in ops], dtype=np.float64)
    lead = (len(ops),) + (1,) * (counts.ndim - 2)  # each op's constants against its counts
    flops_per_pair, weight_per_expert, act_per_pair, shared, shared_pairs = (
        c[:, j].reshape(lead) for j in range(5))
    scale = np.asarray(scale_experts, dtype=np.float64).reshape(lead)
    padded = np.ceil(counts / tile) * tile
    flops = flops_per_pair * padded.sum(axis=-1) * scale
    active = (counts > 0).sum(axis=-1) * scale
    moved = weight_per_expert * active + act_per_pair * counts.sum(axis=-1) * scale
    has = (shared != 0) & (shared_pairs != 0)
    per_shared = np.ceil(shared_pairs / np.where(has, shared, 1.0) / tile) * tile
    flops = np.where(has, flops + flops_per_pair * per_shared * shared, flops)
    moved = np.where(has, moved + weight_per_expert * shared + act_per_pair * shared_pairs,
                     moved)
    seconds = roof_rows(profile, flops.reshape(len(ops), -1).T, moved.reshape(len(ops), -1).T,
                        [op.dtype for op in ops], [op.kind for op in ops])
    return seconds.T.reshape(flops.shape)


def _grouped_constants(op: Op) -> tuple[float, float, float, float, float]:
    """``(FLOPs per pair, weight bytes per expert, activation bytes per pair, shared experts,
    shared pairs)`` of a grouped GEMM op."""
    d = op.dims
    shared = int(d.get("shared_experts", 0))
    shared_pairs = float(d.get("shared_pairs", 0.0))
    pairs_nominal = float(d["pairs"]) + shared_pairs
    active_nominal = float(d["active_experts"]) + shared
    flops_per_pair = op.flops / pairs_nominal if pairs_nominal else 0.0
    weight_per_expert = op.weight_bytes / active_nominal if active_nominal else 0.0
    act_per_pair = (op.bytes - op.weight_bytes) / pairs_nominal if pairs_nominal else 0.0
    return flops_per_pair, weight_per_expert, act_per_pair, float(shared), shared_pairs


_FORMS = {"gemm": _gemm_times, "grouped_gemm": _grouped_nominal_times,
          "lm_head": _lm_head_times}


# --------------------------------------------------------------------------------------------
# Table features, and the roofline at other features
# --------------------------------------------------------------------------------------------


def op_top_k(op: Op, top_k: int | None) -> float | None:
    """The fused MoE kernel's top-k: the op's own (dims ``top_k``) or the model's, plus the
    shared experts it runs (each of the rank's tokens picks them too)."""
    k = op.dims.get("top_k", top_k)
    return float(k) + float(op.dims.get("shared_experts", 0)) if k else None


def _gemm_features(op: Op, top_k: int | None) -> dict[str, float]:
    d = op.dims
    return {"m": d["m"], "n": d["n"], "k": d["k"], "batch": d.get("batch", 1)}


def _grouped_gemm_features(op: Op, top_k: int | None) -> dict[str, float] | None:
    d = op.dims
    k = op_top_k(op, top_k)
    if not d.get("fused") or not k:
        return None
    shared = d.get("shared_experts", 0)
    return {"tokens": (d["pairs"] + d.get("shared_pairs", 0)) / k,
            "experts": d["experts"] + shared, "top_k": k,
            "hidden": d["hidden"], "inter": d["inter"]}


def _gemm_roofline(op: Op, ctx: CostContext, f: dict[str, np.ndarray]) -> np.ndarray:
    profile = ctx.profile
    d, tile = op.dims, eff(profile).gemm_tile_m
    wb = op.weight_bytes / max(d.get("batch", 1) * d["k"] * d["n"], 1)
    m, n, k, b = f["m"], f["n"], f["k"], f["batch"]
    flops = 2.0 * b * np.ceil(m / tile) * tile * n * k
    return roof_at(profile, flops, b * (n * k * wb + 2.0 * (m * k + m * n)), op.dtype,
                   op_class(op))


def _grouped_gemm_roofline(op: Op, ctx: CostContext, f: dict[str, np.ndarray]
                           ) -> np.ndarray:
    profile = ctx.profile
    d, tile = op.dims, eff(profile).gemm_tile_m
    # per pair and per expert, the shared experts run inside the kernel counted among them
    pairs0 = max(d["pairs"] + d.get("shared_pairs", 0), 1e-30)
    act0 = max(d["active_experts"] + d.get("shared_experts", 0), 1e-30)
    hi0 = d["hidden"] * d["inter"]
    flop_u = op.flops / pairs0 / hi0
    weight_u = op.weight_bytes / act0 / hi0
    act_u = (op.bytes - op.weight_bytes) / pairs0 / d["hidden"]
    pairs = f["tokens"] * f["top_k"]
    experts = f["experts"]
    active = np.where(experts > 1, experts * (1.0 - (1.0 - 1.0 / experts) ** pairs),
                      np.minimum(pairs, 1.0))
    padded = np.ceil(pairs / np.maximum(active, 1e-30) / tile) * tile * active
    hi = f["hidden"] * f["inter"]
    return roof_at(profile, flop_u * hi * padded,
                   weight_u * hi * active + act_u * f["hidden"] * pairs, op.dtype, op.kind)


#: op kind -> how it is costed
COSTING: dict[str, KindCosting] = {
    "gemm": KindCosting("gemm", times, COMPUTE_KEYS, features=_gemm_features,
                        roofline_at=_gemm_roofline),
    "grouped_gemm": KindCosting("gemm", times, COMPUTE_KEYS, features=_grouped_gemm_features,
                                roofline_at=_grouped_gemm_roofline),
    "lm_head": KindCosting("gemm", times, COMPUTE_KEYS),
}
