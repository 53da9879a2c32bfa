"""How a measured kernel table costs each op kind: ``KIND_COSTING``, one ``KindCosting`` per kind.

The registry covers ``epsim.model.opgraph.OP_KINDS`` in their order, as ``sim.step.roofline``'s
``COST_MODELS`` does; kinds costed alike share one entry object (``dispatch`` and ``combine``).
Letting tables time a new kind is one entry here, beside its ``FEATURES`` in
``epsim.sim.hardware.kernel_tables`` (the hardware side: a table's feature names and order); a
kind only the roofline times needs no more than its source keys.

Glossary:
    features    what a table of the kind is looked up at (``op_features``), by kind:

                * ``gemm``: ``m, n, k, batch`` of its dims (a table without ``batch``: plain
                  GEMMs only);
                * ``grouped_gemm`` (fused MoE only; the unfused gate/up and down GEMMs stay on
                  the roofline): ``tokens`` = the (token, expert) pairs the rank computes /
                  ``top_k``, ``experts`` (local), ``top_k``, ``hidden``, ``inter``. Sampled
                  routing sets each rank's own ``tokens`` (the hottest rank's pairs set its
                  time). When the graph runs the shared expert inside the fused kernel
                  (``Fusion.shared_expert_in_moe``: dims ``shared_experts``, ``shared_pairs``)
                  ``experts`` and ``top_k`` are one more per shared expert (aiter's 33 experts,
                  top-9), and each rank's own tokens join its routed pairs. Its table is the
                  deployment's (``DEPLOYED``): the one naming the step's exchange mode and the
                  plan's MoE layout (``moe_layout``), ``kernel_sets``' selectors;
                * ``attention_decode``: ``batch`` (sequences), ``context``, ``heads``,
                  ``query_tokens``, ``qk_dim`` / ``v_dim`` (MLA: 576 / 512);
                * ``attention_prefill``: ``batch`` (sequences), ``tokens`` (new tokens per
                  sequence), ``context`` (the cached prefix plus them), ``heads``, ``qk_dim`` /
                  ``v_dim`` (DeepSeek's MHA prefill: 192 / 128). A table measured at other
                  head widths (aiconfigurator's absorbed-MLA 576 / 512, aiter's 128 / 128) times
                  the op by its nearest point scaled by the roofline ratio (a transfer);
                * ``dispatch`` / ``combine``: ``tokens`` per rank, ``ranks``, ``hidden``. Under
                  sampled routing ``tokens`` is the rank count that, uniformly routed, would
                  load the busiest link as much as this step's routing does. A table naming an
                  exchange ``mode`` (``sim.hardware.a2a``) times only the steps that run in
                  that mode;
                * ``all_reduce`` / ``all_gather``: ``bytes`` (the buffer), ``ranks``.
    table dtype the dtype a table must have to time an op (``kernel_dtype``): the compute dtype
                of what the op computes or sends (``fp8_token128`` -> ``fp8``); the KV cache's
                for decode attention.
    scope       ``intra`` or ``inter``-node: a collective's table is chosen by whether its group
                spans nodes (``table_scope``); every other kind's is ``intra``.
    roofline at features
                the roofline's seconds at features other than the op's own
                (``feature_roofline``): outside a table the nearest point's time is scaled by
                roofline(query) / roofline(point). The op's other constants (bytes per weight,
                head sizes, per-peer row bytes) come from the op.
    source keys the profile figures a kind's roofline reads (``roofline_sources``): the sources
                of a time the roofline gives, or scales.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from epsim.model.dtypes import COMPUTE_DTYPE
from epsim.model.opgraph import Op
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware.kernel_sets import FEATURES, LAYOUT_KINDS
from epsim.sim.hardware.profile import HardwareProfile

from . import roofline

#: kinds whose table a step picks by its deployment (exchange mode and MoE layout) besides the
#: collectives' own exchange mode: the fused MoE, whose kernel follows both
DEPLOYED = LAYOUT_KINDS


def moe_layout(plan: ParallelPlan) -> str:
    """The plan's MoE layout as kernel tables name it (``kernel_tables.LAYOUTS``): ``"ep"``
    under expert parallelism, else ``"tp"`` (every rank holds a slice of every expert)."""
    return "ep" if plan.expert_parallel else "tp"


#: ``(op, top_k) -> {feature: value}``, None where no table can describe the op
FeaturesFn = Callable[[Op, int | None], dict[str, float] | None]
#: ``(op, profile, {feature: [rows]}, inter, captured) -> [rows]`` seconds
RooflineAtFn = Callable[[Op, HardwareProfile, dict[str, np.ndarray], bool, bool], np.ndarray]


def _compute_dtype(op: Op) -> str:
    return COMPUTE_DTYPE.get(op.dtype, op.dtype)


def _kv_cache_dtype(op: Op) -> str:
    """Decode attention's kernels are measured per KV cache dtype (aiter's FP8 MLA decode reads
    an FP8 cache), not per the op's compute dtype."""
    return str(op.dims.get("kv_dtype", "bf16"))


@dataclass(frozen=True)
class KindCosting:
    """How kernel tables cost the op kinds of one entry.

    sources: the profile keys the kind's roofline reads. Example: ``("peak_flops",
        "hbm_bandwidth", "efficiency.hbm_fraction")``.
    features: ``(op, top_k) -> {feature: value}`` a table is looked up at (None for an op no
        table can describe: an unfused grouped GEMM); None: no table times the kind. Example
        (gemm): ``{"m": 512, "n": 7168, "k": 2048, "batch": 1}``.
    roofline_at: ``(op, profile, f, inter, captured) -> [rows]`` seconds of the kind's
        roofline at ``f`` (``{feature: [rows] values}``, every ``FEATURES[kind]`` name);
        ``inter``: the group spans nodes; ``captured``: inside a graph. Given with ``features``.
    table_dtype: ``op -> dtype`` a table must have to time the op. Example: ``"fp8"``.
    scoped: tables of the kind are chosen per scope (the collectives: ``COLLECTIVE_TABLES``).
    exchange: an EP exchange, whose uniform traffic follows the step's exchange mode
        (``sim.hardware.a2a``: node-then-GPU under a hierarchical one).
    """

    sources: tuple[str, ...]
    features: FeaturesFn | None = None
    roofline_at: RooflineAtFn | None = None
    table_dtype: Callable[[Op], str] = _compute_dtype
    scoped: bool = False
    exchange: bool = False


# --------------------------------------------------------------------------------------------
# Features
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


def _dense_attention(op: Op) -> bool:
    """Whether a dense attention kernel's table describes ``op``: not DSA's sparse attention
    over top-k gathered keys, nor a chunked prefill (a chunk's causal mask is not the
    whole-prompt one tables measure); those fall back to the roofline."""
    d = op.dims
    return not d.get("topk") and not (op.kind == "attention_prefill" and d.get("chunk"))


def _attention_decode_features(op: Op, top_k: int | None) -> dict[str, float] | None:
    d = op.dims
    if not _dense_attention(op):
        return None
    return {"batch": d["seqs"], "context": d["context"], "heads": d["heads"],
            "query_tokens": d.get("query_tokens", 1), "qk_dim": d["qk_dim"],
            "v_dim": d["v_dim"]}


def _attention_prefill_features(op: Op, top_k: int | None) -> dict[str, float] | None:
    d = op.dims
    if not _dense_attention(op):
        return None
    new = d["new_tokens"]
    return {"batch": d["seqs"], "tokens": new, "context": max(d["context"], new),
            "heads": d["heads"], "qk_dim": d["qk_dim"], "v_dim": d["v_dim"]}


def _exchange_features(op: Op, top_k: int | None) -> dict[str, float]:
    d = op.dims
    return {"tokens": d["tokens"], "ranks": d["group_size"], "hidden": d["hidden"]}


def _collective_features(op: Op, top_k: int | None) -> dict[str, float]:
    return {"bytes": op.bytes_read, "ranks": op.dims["group_size"]}


# --------------------------------------------------------------------------------------------
# The roofline at other features (to scale the nearest point outside a table)
# --------------------------------------------------------------------------------------------


def _roof(profile: HardwareProfile, flops: np.ndarray, moved: np.ndarray, dtype: str,
          kind: str) -> np.ndarray:
    t_f = flops / roofline.achievable_flops(profile, dtype)
    t_b = moved / roofline.achievable_bandwidth(profile)
    e = profile.require_efficiency()
    if e.roofline == "sum":
        return e.scale(kind) * t_f + e.bytes_scale(kind) * t_b
    return np.maximum(t_f, t_b)


def _gemm_roofline(op: Op, profile: HardwareProfile, f: dict[str, np.ndarray], inter: bool,
                   captured: bool) -> np.ndarray:
    d, tile = op.dims, profile.require_efficiency().gemm_tile_m
    wb = op.weight_bytes / max(d.get("batch", 1) * d["k"] * d["n"], 1)
    m, n, k, b = f["m"], f["n"], f["k"], f["batch"]
    flops = 2.0 * b * np.ceil(m / tile) * tile * n * k
    return _roof(profile, flops, b * (n * k * wb + 2.0 * (m * k + m * n)), op.dtype,
                 roofline.op_class(op))


def _grouped_gemm_roofline(op: Op, profile: HardwareProfile, f: dict[str, np.ndarray],
                           inter: bool, captured: bool) -> np.ndarray:
    d, tile = op.dims, profile.require_efficiency().gemm_tile_m
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
    return _roof(profile, flop_u * hi * padded,
                 weight_u * hi * active + act_u * f["hidden"] * pairs, op.dtype, op.kind)


def _attention_decode_roofline(op: Op, profile: HardwareProfile, f: dict[str, np.ndarray],
                               inter: bool, captured: bool) -> np.ndarray:
    d, e = op.dims, profile.require_efficiency()
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
        return _roof(profile, flops, moved, roofline.attention_math_dtype(op), op.kind) / occ
    return np.maximum(flops / rate, moved / roofline.achievable_bandwidth(profile)) / occ


def _attention_prefill_roofline(op: Op, profile: HardwareProfile, f: dict[str, np.ndarray],
                                inter: bool, captured: bool) -> np.ndarray:
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
    return _roof(profile, flops, moved, roofline.attention_math_dtype(op), op.kind)


def _uniform_collective(kind: str, profile: HardwareProfile, ranks: int, per_peer: np.ndarray,
                        inter: bool, captured: bool) -> np.ndarray:
    """A collective moving ``per_peer`` bytes between every pair of ``ranks`` members."""
    nodes = np.zeros(ranks, dtype=np.int64)
    if inter:
        gpn = profile.gpus_per_node
        nodes = np.arange(ranks) // gpn if ranks > gpn else np.arange(ranks)
    unit = np.ones((ranks, ranks))
    lat = roofline.collective_latency(kind, profile, captured, ranks)
    per_byte = float(roofline.collective_time(kind, unit, profile, nodes, captured)) - lat
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
                         op: Op, profile: HardwareProfile, f: dict[str, np.ndarray], inter: bool,
                         captured: bool) -> np.ndarray:
    """A collective's roofline, uniform traffic of ``peer_bytes(op, f, rows, ranks)`` per peer;
    rows grouped by their ``ranks`` (the group's layout, latency and busiest link follow it)."""
    out = np.zeros(len(f["ranks"]))
    for r in np.unique(f["ranks"]):
        rows = f["ranks"] == r
        ranks = int(r)
        out[rows] = _uniform_collective(op.kind, profile, ranks, peer_bytes(op, f, rows, ranks),
                                        inter, captured)
    return out


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

# the figures each roofline of sim.step.roofline reads: a GEMM-like compute roof, a streaming
# op's, an EP exchange's (NIC and all-to-all latency too), another collective's
_COMPUTE_KEYS = ("peak_flops", "hbm_bandwidth", "efficiency.gemm_flops_fraction",
                 "efficiency.hbm_fraction", "efficiency.gemm_tile_m")
_STREAMING_KEYS = ("peak_flops", "hbm_bandwidth", "efficiency.hbm_fraction")
_EXCHANGE_KEYS = ("fabric", "nic_bandwidth_per_gpu", "efficiency.link_bandwidth_usable",
                  "efficiency.nic_bandwidth_usable", "efficiency.a2a_latency_s")
_COLLECTIVE_KEYS = ("fabric", "efficiency.link_bandwidth_usable",
                    "efficiency.collective_latency_s", "efficiency.collective_latency_graph_s")

#: kinds only the roofline times: on the GEMM's figures (LM head), streaming
_COMPUTE = KindCosting(sources=_COMPUTE_KEYS)
_STREAMING = KindCosting(sources=_STREAMING_KEYS)
_EXCHANGE = KindCosting(sources=_EXCHANGE_KEYS, features=_exchange_features,
                        roofline_at=partial(_collective_roofline, _exchange_peer_bytes),
                        scoped=True, exchange=True)

#: op kind -> how kernel tables cost it (every ``OP_KINDS`` member, in its order)
KIND_COSTING: dict[str, KindCosting] = {
    "gemm": KindCosting(sources=_COMPUTE_KEYS, features=_gemm_features,
                        roofline_at=_gemm_roofline),
    "grouped_gemm": KindCosting(sources=_COMPUTE_KEYS, features=_grouped_gemm_features,
                                roofline_at=_grouped_gemm_roofline),
    "attention_decode": KindCosting(
        sources=(*_COMPUTE_KEYS, "efficiency.attention_decode_flops",
                 "efficiency.attention_split_tokens"),
        features=_attention_decode_features, roofline_at=_attention_decode_roofline,
        table_dtype=_kv_cache_dtype),
    "attention_prefill": KindCosting(sources=_COMPUTE_KEYS,
                                     features=_attention_prefill_features,
                                     roofline_at=_attention_prefill_roofline),
    "norm": _STREAMING,
    "rope": _STREAMING,
    "router": _STREAMING,
    "dispatch": _EXCHANGE,
    "combine": _EXCHANGE,
    "all_reduce": KindCosting(sources=_COLLECTIVE_KEYS, features=_collective_features,
                              roofline_at=partial(_collective_roofline, _all_reduce_peer_bytes),
                              scoped=True),
    "all_gather": KindCosting(sources=_COLLECTIVE_KEYS, features=_collective_features,
                              roofline_at=partial(_collective_roofline, _all_gather_peer_bytes),
                              scoped=True),
    "elementwise": _STREAMING,
    "embedding": _STREAMING,
    "lm_head": _COMPUTE,
    "sample": _STREAMING,
    "indexer": _COMPUTE,
}


def costing(kind: str) -> KindCosting:
    """``kind``'s entry; a kind outside the registry is costed as a streaming op (the roofline
    alone, its sources the streaming keys)."""
    return KIND_COSTING.get(kind, _STREAMING)


# --------------------------------------------------------------------------------------------
# What the timers ask of an op's kind
# --------------------------------------------------------------------------------------------


def kernel_dtype(op: Op) -> str:
    """The dtype a table for ``op`` must have: the KV cache's for decode attention, else the
    op's compute dtype."""
    return costing(op.kind).table_dtype(op)


def scope_of(nodes: np.ndarray | None) -> str:
    return "inter" if nodes is not None and len(set(np.asarray(nodes).tolist())) > 1 else "intra"


def table_scope(op: Op, nodes: np.ndarray | None) -> str:
    """The scope of the table that times ``op`` with its group on ``nodes`` (``[members]``)."""
    return scope_of(nodes) if costing(op.kind).scoped else "intra"


def op_features(op: Op, top_k: int | None = None) -> dict[str, float] | None:
    """The features a table of ``op.kind`` is looked up at (module docstring); None when no
    table can describe the op (an unfused grouped GEMM, a kind without tables)."""
    features = costing(op.kind).features
    return features(op, top_k) if features is not None else None


def feature_roofline(op: Op, profile: HardwareProfile, x: np.ndarray, *, top_k: int | None = None,
                     inter: bool = False, captured: bool = False) -> np.ndarray:
    """Seconds of ``op.kind``'s roofline at each row of ``x`` (``[rows, features]`` in
    ``FEATURES[op.kind]`` order), the op's other constants (bytes per weight, head sizes, ...)
    taken from ``op``."""
    names = [n for n, _ in FEATURES[op.kind]]
    f = {n: x[:, j] for j, n in enumerate(names)}
    return costing(op.kind).roofline_at(op, profile, f, inter, captured)


def roofline_sources(kind: str, profile: HardwareProfile) -> dict[str, Any]:
    """``{"profile:<key>": {"profile": <its file or name>, "key": ..., "source": ...}}`` for
    the profile figures ``kind``'s roofline reads, where the profile cites a source."""
    cited = profile.sources
    return {f"profile:{k}": {"profile": profile.name, "key": k, "source": cited[k]}
            for k in costing(kind).sources if k in cited}
