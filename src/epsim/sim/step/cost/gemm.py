"""The GEMM family: ``gemm``, ``grouped_gemm`` (fused MoE), ``lm_head``.

* GEMMs pay for whole matrix-core tiles: a GEMM of ``M`` rows computes ``ceil(M / tile) * tile``
  rows (``gemm_tile_m``). At decode's skinny ``M`` the weight bytes dominate and the op is
  memory-bound at the achievable HBM bandwidth: no separate "small-M efficiency" constant.
* A grouped (fused-MoE) GEMM reads the weights of the experts that received tokens and pays the
  tile padding per expert (``grouped_gemm_time`` takes the per-expert counts of this step).
* The LM head is a plain roofline on the op's dtype, read on the GEMM's figures.

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

import numpy as np

from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import HardwareProfile

from .roofline import (
    COMPUTE_KEYS,
    KindCosting,
    eff,
    op_class,
    padded_rows,
    roof_at,
    roofline,
    streaming_dtype,
)

KINDS = ("gemm", "grouped_gemm", "lm_head")


# --------------------------------------------------------------------------------------------
# The roofline at the op
# --------------------------------------------------------------------------------------------


def gemm_time(op: Op, profile: HardwareProfile) -> float:
    d = op.dims
    tile = eff(profile).gemm_tile_m
    flops = op.flops * padded_rows(d["m"], tile) / d["m"] if d["m"] else 0.0
    return roofline(profile, flops, op.bytes, op.dtype, op_class(op))


def lm_head_time(op: Op, profile: HardwareProfile) -> float:
    return roofline(profile, op.flops, op.bytes, streaming_dtype(op, profile), op.kind)


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
    tile = eff(profile).gemm_tile_m
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
    return roof_at(profile, flops, moved, op.dtype, op.kind)


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


def _gemm_roofline(op: Op, profile: HardwareProfile, f: dict[str, np.ndarray], inter: bool,
                   captured: bool) -> np.ndarray:
    d, tile = op.dims, eff(profile).gemm_tile_m
    wb = op.weight_bytes / max(d.get("batch", 1) * d["k"] * d["n"], 1)
    m, n, k, b = f["m"], f["n"], f["k"], f["batch"]
    flops = 2.0 * b * np.ceil(m / tile) * tile * n * k
    return roof_at(profile, flops, b * (n * k * wb + 2.0 * (m * k + m * n)), op.dtype,
                   op_class(op))


def _grouped_gemm_roofline(op: Op, profile: HardwareProfile, f: dict[str, np.ndarray],
                           inter: bool, captured: bool) -> np.ndarray:
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
    "gemm": KindCosting("gemm", gemm_time, COMPUTE_KEYS, features=_gemm_features,
                        roofline_at=_gemm_roofline),
    "grouped_gemm": KindCosting("gemm", grouped_gemm_nominal, COMPUTE_KEYS,
                                features=_grouped_gemm_features,
                                roofline_at=_grouped_gemm_roofline),
    "lm_head": KindCosting("gemm", lm_head_time, COMPUTE_KEYS),
}
