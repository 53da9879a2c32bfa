"""The attention family: ``attention_decode``, ``attention_prefill``, and DSA's ``indexer``.

Decode attention is the roofline (its math runs as matrix ops in the KV cache's dtype: FP8 with
an FP8 cache, as aiter's FP8 MLA decode kernel does, else BF16; the FP8 cache also halves the
bytes), its compute roof the published decode kernel's achieved rate where the profile has one
(``attention_decode_flops``), times a wave-quantisation occupancy: ``seqs * ceil(context /
attention_split_tokens)`` work items fill ``ceil(items / CUs)`` waves of the GPU's CUs. Prefill
attention is the plain roofline; the indexer one on the FP8 matrix rate.

Table features (``kernel_tables.FEATURES``): ``attention_decode``: ``batch`` (sequences),
``context``, ``heads``, ``query_tokens``, ``qk_dim`` / ``v_dim`` (MLA: 576 / 512), its table
dtype the KV cache's; ``attention_prefill``: ``batch`` (sequences), ``tokens`` (new tokens per
sequence), ``context`` (the cached prefix plus them), ``heads``, ``qk_dim`` / ``v_dim``
(DeepSeek's MHA prefill: 192 / 128). A table measured at other head widths (aiconfigurator's
absorbed-MLA 576 / 512, aiter's 128 / 128) times the op by its nearest point scaled by the
roofline ratio (a transfer). DSA's sparse attention and a chunked prefill have no table
features (the roofline times them); no table times the indexer.
"""

from __future__ import annotations

import math

import numpy as np

from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import HardwareProfile

from .roofline import (
    COMPUTE_KEYS,
    KindCosting,
    achievable_bandwidth,
    eff,
    roof,
    roof_at,
    roofline,
)

KINDS = ("attention_decode", "attention_prefill", "indexer")


def attention_occupancy(profile: HardwareProfile, seqs: int, context: int) -> float:
    """Share of the CUs busy on average: ``items / (waves * CUs)`` for the split-KV work items."""
    split = eff(profile).attention_split_tokens
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
    kernel_rate = eff(profile).attention_decode_flops.get(str(d.get("kv_dtype")))
    if kernel_rate is None:
        return roofline(profile, op.flops, op.bytes, attention_math_dtype(op), op.kind) / occ
    # a published decode kernel's achieved rate replaces the GEMM's as the compute roof
    return float(roof(op.flops, op.bytes, kernel_rate, achievable_bandwidth(profile))) / occ


def attention_prefill_time(op: Op, profile: HardwareProfile) -> float:
    return roofline(profile, op.flops, op.bytes, attention_math_dtype(op), op.kind)


def indexer_time(op: Op, profile: HardwareProfile) -> float:
    """DSA's lightning indexer: no kernel table measures it, so a roofline on the FP8 matrix
    rate (DeepGEMM's ``fp8_mqa_logits`` scores in FP8) and HBM, its FLOPs and bytes the graph's
    (``epsim.model.attention_keys.indexer_cost``)."""
    dtype = op.dtype if op.dtype in profile.peak_flops else "bf16"
    return roofline(profile, op.flops, op.bytes, dtype, op.kind)


# --------------------------------------------------------------------------------------------
# Table features, and the roofline at other features
# --------------------------------------------------------------------------------------------


def _kv_cache_dtype(op: Op) -> str:
    """Decode attention's kernels are measured per KV cache dtype (aiter's FP8 MLA decode reads
    an FP8 cache), not per the op's compute dtype."""
    return str(op.dims.get("kv_dtype", "bf16"))


def _dense_attention(op: Op) -> bool:
    """Whether a dense attention kernel's table describes ``op``: not DSA's sparse attention
    over top-k gathered keys, nor a chunked prefill (a chunk's causal mask is not the
    whole-prompt one tables measure); those fall back to the roofline."""
    d = op.dims
    return not d.get("topk") and not (op.kind == "attention_prefill" and d.get("chunk"))


def _decode_features(op: Op, top_k: int | None) -> dict[str, float] | None:
    d = op.dims
    if not _dense_attention(op):
        return None
    return {"batch": d["seqs"], "context": d["context"], "heads": d["heads"],
            "query_tokens": d.get("query_tokens", 1), "qk_dim": d["qk_dim"],
            "v_dim": d["v_dim"]}


def _prefill_features(op: Op, top_k: int | None) -> dict[str, float] | None:
    d = op.dims
    if not _dense_attention(op):
        return None
    new = d["new_tokens"]
    return {"batch": d["seqs"], "tokens": new, "context": max(d["context"], new),
            "heads": d["heads"], "qk_dim": d["qk_dim"], "v_dim": d["v_dim"]}


def _decode_roofline(op: Op, profile: HardwareProfile, f: dict[str, np.ndarray], inter: bool,
                     captured: bool) -> np.ndarray:
    d, e = op.dims, eff(profile)
    seqs, ctx, heads = d["seqs"], d["context"], d["heads"]
    q0 = d.get("query_tokens", 1)
    kv_row = (op.bytes_read - seqs * q0 * heads * d["qk_dim"] * 2.0) / (seqs * ctx)
    per_query = (op.bytes - seqs * ctx * kv_row) / (seqs * q0 * heads)
    flop_u = op.flops / (seqs * q0 * heads * ctx)
    b, c, h, q = f["batch"], f["context"], f["heads"], f["query_tokens"]
    width = (f["qk_dim"] + f["v_dim"]) / (d["qk_dim"] + d["v_dim"])
    flops = flop_u * b * q * h * c * width
    moved = b * c * kv_row * f["qk_dim"] / d["qk_dim"] + per_query * b * q * h * width
    split = e.attention_split_tokens
    items = b * np.ceil(c / split)
    cus = profile.compute_units
    occ = items / (np.ceil(items / cus) * cus)
    rate = e.attention_decode_flops.get(str(d.get("kv_dtype")))
    if rate is None:
        return roof_at(profile, flops, moved, attention_math_dtype(op), op.kind) / occ
    return roof(flops, moved, rate, achievable_bandwidth(profile)) / occ


def _prefill_roofline(op: Op, profile: HardwareProfile, f: dict[str, np.ndarray], inter: bool,
                      captured: bool) -> np.ndarray:
    """Causal attention of ``tokens`` new queries per sequence after ``context - tokens``
    cached ones (``p``):
    ``2 heads batch (tokens p + tokens (tokens + 1) / 2) (qk + v)`` FLOPs (the graph's
    count); the bytes of the op per (new token, head) scaled by the head widths."""
    d = op.dims
    new0 = d["new_tokens"]
    rows0 = max(d["seqs"] * new0 * d["heads"], 1e-30)
    width0 = d["qk_dim"] + d["v_dim"]
    b, s, h = f["batch"], f["tokens"], f["heads"]
    p = np.maximum(f["context"] - s, 0.0)
    width = f["qk_dim"] + f["v_dim"]
    flops = 2.0 * h * b * (s * p + s * (s + 1.0) / 2.0) * width
    moved = op.bytes / rows0 * b * s * h * width / width0
    return roof_at(profile, flops, moved, attention_math_dtype(op), op.kind)


#: op kind -> how it is costed
COSTING: dict[str, KindCosting] = {
    "attention_decode": KindCosting(
        "attention", attention_decode_time,
        (*COMPUTE_KEYS, "efficiency.attention_decode_flops", "efficiency.attention_split_tokens"),
        features=_decode_features, roofline_at=_decode_roofline, table_dtype=_kv_cache_dtype),
    "attention_prefill": KindCosting("attention", attention_prefill_time, COMPUTE_KEYS,
                                     features=_prefill_features,
                                     roofline_at=_prefill_roofline),
    "indexer": KindCosting("attention", indexer_time, COMPUTE_KEYS),
}
