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

from collections.abc import Sequence

import numpy as np

from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import HardwareProfile

from .context import CostContext
from .roofline import (
    COMPUTE_KEYS,
    KindCosting,
    achievable_bandwidth,
    eff,
    per_kind,
    roof,
    roof_at,
    roof_rows,
    streaming_dtype,
)

KINDS = ("attention_decode", "attention_prefill", "indexer")


def attention_occupancy(profile: HardwareProfile, seqs, context):
    """Share of the CUs busy on average: ``items / (waves * CUs)`` for the split-KV work items
    (``seqs``, ``context``: numbers or arrays, whole numbers)."""
    split = eff(profile).attention_split_tokens
    items = np.multiply(seqs, np.ceil(np.divide(context, split)))
    cus = profile.compute_units
    return items / (np.ceil(items / cus) * cus)


def attention_math_dtype(op: Op) -> str:
    """FP8 KV cache: the kernel runs FP8 matrix ops (aiter's FP8 MLA decode quantises the query
    to FP8); a BF16 cache: BF16 matrix ops."""
    return "fp8" if op.dims.get("kv_dtype") == "fp8" else "bf16"


def times(ops: Sequence[Op], ctx: CostContext) -> np.ndarray:
    """``[ops]`` seconds of each op's roofline (any mix of the family's kinds), before
    ``calibrated``: the family's one formula, an op's scalar time its value at ``[op]``."""
    return per_kind(ops, ctx, _FORMS)


def _roof(ops: Sequence[Op], profile: HardwareProfile, dtypes: list[str]) -> np.ndarray:
    return roof_rows(profile, [op.flops for op in ops], [op.bytes for op in ops], dtypes,
                     [op.kind for op in ops])


def _decode_times(ops: Sequence[Op], profile: HardwareProfile) -> np.ndarray:
    """The roofline over the wave occupancy; its compute roof the published decode kernel's
    achieved rate where the profile has one for the op's KV dtype."""
    e = eff(profile)
    # DSA's sparse decode splits the keys it gathers (``keys``), not the whole context
    seqs = np.array([int(op.dims["seqs"]) for op in ops], dtype=np.float64)
    keys = np.array([int(op.dims.get("keys", op.dims["context"])) for op in ops],
                    dtype=np.float64)
    occ = attention_occupancy(profile, seqs, keys)
    rates = [e.attention_decode_flops.get(str(op.dims.get("kv_dtype"))) for op in ops]
    kernel = np.array([r is not None for r in rates])
    plain = _roof(ops, profile, [attention_math_dtype(op) for op in ops])
    # a published decode kernel's achieved rate replaces the GEMM's as the compute roof
    rate = np.array([r if r is not None else 1.0 for r in rates], dtype=np.float64)
    fast = roof(np.array([op.flops for op in ops], dtype=np.float64),
                np.array([op.bytes for op in ops], dtype=np.float64), rate,
                achievable_bandwidth(profile))
    return np.where(kernel, fast, plain) / occ


def _prefill_times(ops: Sequence[Op], profile: HardwareProfile) -> np.ndarray:
    return _roof(ops, profile, [attention_math_dtype(op) for op in ops])


def _indexer_times(ops: Sequence[Op], profile: HardwareProfile) -> np.ndarray:
    """DSA's lightning indexer: no kernel table measures it, so a roofline on the FP8 matrix
    rate (DeepGEMM's ``fp8_mqa_logits`` scores in FP8) and HBM, its FLOPs and bytes the graph's
    (``epsim.model.attention_keys.indexer_cost``)."""
    return _roof(ops, profile, [streaming_dtype(op, profile) for op in ops])


_FORMS = {"attention_decode": _decode_times, "attention_prefill": _prefill_times,
          "indexer": _indexer_times}


def attention_prefill_time(op: Op, profile: HardwareProfile) -> float:
    """One prefill attention op's roofline seconds (``times`` at ``[op]``)."""
    return float(times([op], CostContext(profile))[0])


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


def _decode_roofline(op: Op, ctx: CostContext, f: dict[str, np.ndarray]) -> np.ndarray:
    profile = ctx.profile
    d, e = op.dims, eff(profile)
    seqs, context, heads = d["seqs"], d["context"], d["heads"]
    q0 = d.get("query_tokens", 1)
    kv_row = (op.bytes_read - seqs * q0 * heads * d["qk_dim"] * 2.0) / (seqs * context)
    per_query = (op.bytes - seqs * context * kv_row) / (seqs * q0 * heads)
    flop_u = op.flops / (seqs * q0 * heads * context)
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


def _prefill_roofline(op: Op, ctx: CostContext, f: dict[str, np.ndarray]) -> np.ndarray:
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
    return roof_at(ctx.profile, flops, moved, attention_math_dtype(op), op.kind)


#: op kind -> how it is costed
COSTING: dict[str, KindCosting] = {
    "attention_decode": KindCosting(
        "attention", times,
        (*COMPUTE_KEYS, "efficiency.attention_decode_flops", "efficiency.attention_split_tokens"),
        features=_decode_features, roofline_at=_decode_roofline, table_dtype=_kv_cache_dtype),
    "attention_prefill": KindCosting("attention", times, COMPUTE_KEYS,
                                     features=_prefill_features,
                                     roofline_at=_prefill_roofline),
    "indexer": KindCosting("attention", times, COMPUTE_KEYS),
}
