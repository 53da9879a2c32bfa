"""Op times from a profile's measured kernel tables (``epsim.sim.hardware.kernel_sets``), and how they were got.

Where the selected kernel set (``HardwareProfile.with_kernels``) has a table for an op's kind,
dtype and scope, the op's time is the table's at the op's features (exact, interpolated, or the
nearest point scaled by this module's roofline ratio), divided by the speedups of the sets it was
scaled through; elsewhere the roofline of :mod:`sim.step.roofline` (times those speedups). Without a
kernel set the roofline alone, bit for bit.

An op's features (``op_features``):

* ``gemm``: ``m, n, k, batch`` of its dims (a table without ``batch``: plain GEMMs only);
* ``grouped_gemm`` (fused MoE only; the unfused gate/up and down GEMMs stay on the roofline):
  ``tokens`` = the (token, expert) pairs the rank computes / ``top_k``, ``experts`` (local),
  ``top_k``, ``hidden``, ``inter``. Sampled routing sets each rank's own ``tokens`` (the hottest
  rank's pairs set its time). When the graph runs the shared expert inside the fused kernel
  (``Fusion.shared_expert_in_moe``: dims ``shared_experts``, ``shared_pairs``) ``experts`` and
  ``top_k`` are one more per shared expert (aiter's 33 experts, top-9), and each rank's own
  tokens join its routed pairs;
* ``attention_decode``: ``batch`` (sequences), ``context``, ``heads``, ``query_tokens``,
  ``qk_dim`` / ``v_dim`` (MLA: 576 / 512); dtype = the KV cache's;
* ``dispatch`` / ``combine``: ``tokens`` per rank, ``ranks``, ``hidden``; dtype = the compute
  dtype of what is sent (``fp8_token128`` -> ``fp8``); scope ``inter`` when the group spans
  nodes. Under sampled routing ``tokens`` is the rank count that, uniformly routed, would load
  the busiest link as much as this step's routing does. A table naming an exchange ``mode``
  (``sim.hardware.a2a``) times only the steps that run in that mode;
* ``all_reduce`` / ``all_gather``: ``bytes`` (the buffer), ``ranks``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from epsim.model.dtypes import COMPUTE_DTYPE
from epsim.model.opgraph import OP_KINDS, Op
from epsim.sim.hardware import a2a
from epsim.sim.hardware.a2a import A2AMode
from epsim.sim.hardware.kernel_sets import EXTRAPOLATED, FEATURES, METHODS, Table
from epsim.sim.hardware.profile import HardwareProfile

from . import roofline

_OUTSIDE_IDS = 8  # op ids listed per shape outside every table
#: swept values from which a lookup is made once per distinct value (a step's fused-MoE token
#: counts repeat: 928 values of DeepSeek-R1 on 8 GPUs hold about 190 distinct ones)
_DISTINCT_FROM = 256


def kernel_dtype(op: Op) -> str:
    """The dtype a table for ``op`` must have: the KV cache's for decode attention, else the
    op's compute dtype."""
    if op.kind == "attention_decode":
        return str(op.dims.get("kv_dtype", "bf16"))
    return COMPUTE_DTYPE.get(op.dtype, op.dtype)


def scope_of(nodes: np.ndarray | None) -> str:
    return "inter" if nodes is not None and len(set(np.asarray(nodes).tolist())) > 1 else "intra"


def op_top_k(op: Op, top_k: int | None) -> float | None:
    """The fused MoE kernel's top-k: the op's own (dims ``top_k``) or the model's, plus the
    shared experts it runs (each of the rank's tokens picks them too)."""
    k = op.dims.get("top_k", top_k)
    return float(k) + float(op.dims.get("shared_experts", 0)) if k else None


def op_features(op: Op, top_k: int | None = None) -> dict[str, float] | None:
    """The features a table of ``op.kind`` is looked up at (module docstring); None when no
    table can describe the op (an unfused grouped GEMM, a kind without tables)."""
    d = op.dims
    if op.kind == "gemm":
        return {"m": d["m"], "n": d["n"], "k": d["k"], "batch": d.get("batch", 1)}
    if op.kind == "grouped_gemm":
        k = op_top_k(op, top_k)
        if not d.get("fused") or not k:
            return None
        shared = d.get("shared_experts", 0)
        return {"tokens": (d["pairs"] + d.get("shared_pairs", 0)) / k,
                "experts": d["experts"] + shared, "top_k": k,
                "hidden": d["hidden"], "inter": d["inter"]}
    if op.kind == "attention_decode":
        return {"batch": d["seqs"], "context": d["context"], "heads": d["heads"],
                "query_tokens": d.get("query_tokens", 1), "qk_dim": d["qk_dim"],
                "v_dim": d["v_dim"]}
    if op.kind in ("dispatch", "combine"):
        return {"tokens": d["tokens"], "ranks": d["group_size"], "hidden": d["hidden"]}
    if op.kind in ("all_reduce", "all_gather"):
        return {"bytes": op.bytes_read, "ranks": d["group_size"]}
    return None


def _plan(op: Op, profile: HardwareProfile, top_k: int | None, nodes: np.ndarray | None,
          mode: A2AMode | None = None):
    """``(table or None, factor, chain, features)`` under the selected set; None: no set."""
    kernels = profile.kernels
    if kernels is None or profile.active_kernels is None:
        return None
    scope = scope_of(nodes) if op.is_collective else "intra"
    table, factor, chain = kernels.resolve(profile.kernel_set, op.kind, kernel_dtype(op), scope,
                                           mode.name if mode is not None else "")
    features = op_features(op, top_k) if table is not None else None
    if features is None or not table.describes(features):
        table, features = None, None
    return table, factor, chain, features


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


def feature_roofline(op: Op, profile: HardwareProfile, x: np.ndarray, *, top_k: int | None = None,
                     inter: bool = False, captured: bool = False) -> np.ndarray:
    """Seconds of ``op.kind``'s roofline at each row of ``x`` (``[rows, features]`` in
    ``FEATURES[op.kind]`` order), the op's other constants (bytes per weight, head sizes, ...)
    taken from ``op``."""
    names = [n for n, _ in FEATURES[op.kind]]
    f = {n: x[:, j] for j, n in enumerate(names)}
    d, e = op.dims, profile.require_efficiency()
    tile = e.gemm_tile_m
    if op.kind == "gemm":
        wb = op.weight_bytes / max(d.get("batch", 1) * d["k"] * d["n"], 1)
        m, n, k, b = f["m"], f["n"], f["k"], f["batch"]
        flops = 2.0 * b * np.ceil(m / tile) * tile * n * k
        return _roof(profile, flops, b * (n * k * wb + 2.0 * (m * k + m * n)), op.dtype,
                     roofline.op_class(op))
    if op.kind == "grouped_gemm":
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
    if op.kind == "attention_decode":
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
    out = np.zeros(len(x))
    for r in np.unique(f["ranks"]):
        rows = f["ranks"] == r
        ranks = int(r)
        if op.kind in ("dispatch", "combine"):
            k = float(d.get("top_k", 1))
            hit0 = d["expected_tokens_per_peer"] / max(d["tokens"], 1e-30)
            reach = 1.0 - (1.0 - 1.0 / ranks) ** k if ranks > 1 else 1.0
            reach0 = 1.0 - (1.0 - 1.0 / d["group_size"]) ** k if d["group_size"] > 1 else 1.0
            row_bytes = d["bytes_per_token"] * f["hidden"][rows] / d["hidden"]
            per_peer = f["tokens"][rows] * hit0 * reach / reach0 * row_bytes
        elif op.kind == "all_reduce":
            per_peer = 2.0 * f["bytes"][rows] / ranks
        else:
            per_peer = f["bytes"][rows]
        out[rows] = _uniform_collective(op.kind, profile, ranks, per_peer, inter, captured)
    return out


# --------------------------------------------------------------------------------------------
# Times
# --------------------------------------------------------------------------------------------


def nominal_collective(op: Op, profile: HardwareProfile, nodes: np.ndarray,
                       captured: bool, mode: A2AMode | None = None) -> float:
    """The roofline of a collective under its nominal (uniform) per-peer bytes; ``nodes``: the
    node of each member (the first ``group_size`` entries are used); ``mode``: an EP exchange's
    (``sim.hardware.a2a``; node-then-GPU traffic under a hierarchical one)."""
    peers = np.asarray(op.peer_bytes, dtype=np.float64)
    members = np.asarray(nodes)[:len(peers)]
    layout = a2a.node_layout(members) if mode is not None and mode.hierarchical else None
    if layout is not None and op.kind in ("dispatch", "combine"):
        d = op.dims
        tokens, node_tokens = a2a.uniform_tokens(d["expected_tokens_per_peer"], d["tokens"],
                                                 d["top_k"], len(peers), layout[1])
        traffic = a2a.link_traffic(op.kind, mode, tokens, members,
                                   lambda: node_tokens) * d["bytes_per_token"]
    else:
        traffic = np.tile(peers, (len(peers), 1))
    return float(roofline.collective_time(op.kind, traffic, profile, members, captured))


def _table_seconds(op: Op, profile: HardwareProfile, table: Table, fixed: tuple[float, ...],
                   values: np.ndarray, top_k: int | None, inter: bool, captured: bool
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seconds, method, nearest)`` at each of ``values`` (``[n]``), extrapolations scaled by
    the roofline's ratio. Every step is elementwise (a value's answer does not depend on the
    others), so repeated values are looked up once, with equal results."""
    if len(values) >= _DISTINCT_FROM:
        distinct, where = np.unique(values, return_inverse=True)
        if len(distinct) < len(values):
            secs, method, nearest = _table_seconds(op, profile, table, fixed, distinct, top_k,
                                                   inter, captured)
            return secs[where], method[where], nearest[where]
    if len(values) == 1:  # one op's own features: the scalar path, equal results
        return _table_seconds_one(op, profile, table, fixed, float(values[0]), top_k, inter,
                                  captured)
    method, secs, nearest = table.locate(fixed, values)
    out = method == EXTRAPOLATED
    if out.any():
        q = np.column_stack([np.tile(np.asarray(fixed, dtype=np.float64), (int(out.sum()), 1)),
                             values[out]])
        p = table.x[nearest[out]]
        both = feature_roofline(op, profile, np.vstack([q, p]), top_k=top_k, inter=inter,
                                captured=captured)
        rq, rp = both[:len(q)], both[len(q):]
        secs[out] *= np.where(rp > 0, rq / np.where(rp > 0, rp, 1.0), 1.0)
    return secs, method, nearest


def _table_seconds_one(op: Op, profile: HardwareProfile, table: Table, fixed: tuple[float, ...],
                       value: float, top_k: int | None, inter: bool, captured: bool
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_table_seconds` of one value: the table's scalar lookup and, outside it, one
    roofline call for the query and its nearest point (the same float operations)."""
    how, secs, near = table.locate_one(fixed, value)
    if how == EXTRAPOLATED:
        rq, rp = feature_roofline(op, profile, np.array([(*fixed, value), table.x[near]]),
                                  top_k=top_k, inter=inter, captured=captured).tolist()
        secs = secs * (rq / rp if rp > 0 else 1.0)
    return np.array([secs]), np.array([how]), np.array([near])


def op_seconds(op: Op, profile: HardwareProfile, fallback: Callable[[], float], *,
               top_k: int | None = None, nodes: np.ndarray | None = None,
               captured: bool = False, mode: A2AMode | None = None) -> float:
    """``op``'s seconds under the selected kernel set; ``fallback()`` is its roofline time
    (returned as is where no table and no speedup applies); ``mode``: an EP exchange's."""
    secs = _seconds(op, profile, None, fallback, top_k, nodes, captured, mode)
    return float(secs[0]) if isinstance(secs, np.ndarray) else float(secs)


def op_time(op: Op, profile: HardwareProfile, top_k: int | None = None) -> float:
    """Seconds one op takes on its own (no launch cost, no interference): the selected kernel
    set's table where it has one (``top_k``: the model's, for a fused MoE op whose dims lack
    it), else the roofline (``roofline.roofline_op_time``)."""
    if profile.active_kernels is not None:
        return op_seconds(op, profile, lambda: roofline.roofline_op_time(op, profile),
                          top_k=top_k)
    return roofline.final_scaled(op, profile, roofline.roofline_op_time(op, profile))


def answered_by_table(op: Op, profile: HardwareProfile, *, top_k: int | None = None,
                      nodes: np.ndarray | None = None, mode: A2AMode | None = None) -> bool:
    """Whether a table of the selected set times ``op``: its routed seconds are then a function
    of the swept value alone (no fallback, whose time may read more: per-expert counts)."""
    plan = _plan(op, profile, top_k, nodes, mode)
    return plan is not None and plan[0] is not None


def routed_seconds(op: Op, profile: HardwareProfile, swept: Callable[[], np.ndarray],
                   fallback: Callable[[], np.ndarray], *, top_k: int | None = None,
                   nodes: np.ndarray | None = None, captured: bool = False,
                   mode: A2AMode | None = None) -> np.ndarray:
    """A routed op's seconds at many values of its swept feature (``tokens``: ``swept()``, any
    shape) under the selected kernel set; ``fallback()``: the roofline's, same shape."""
    return _seconds(op, profile, swept, fallback, top_k, nodes, captured, mode)


def _seconds(op: Op, profile: HardwareProfile, swept: Callable[[], np.ndarray] | None,
             fallback: Callable[[], Any], top_k: int | None, nodes: np.ndarray | None,
             captured: bool, mode: A2AMode | None = None) -> Any:
    """The table's seconds at the op's own features (``swept`` None: ``[1]``) or at every value
    ``swept()`` gives its swept feature, times the set's speedups; ``fallback()`` (times them)
    where the set has no table for the op; then times the profile's fitted ``op_final_scale``
    (``roofline.final_scaled``: every timed op passes here or through ``op_time`` once)."""
    return roofline.final_scaled(op, profile, _unscaled(op, profile, swept, fallback, top_k, nodes,
                                                    captured, mode))


def _unscaled(op: Op, profile: HardwareProfile, swept: Callable[[], np.ndarray] | None,
              fallback: Callable[[], Any], top_k: int | None, nodes: np.ndarray | None,
              captured: bool, mode: A2AMode | None) -> Any:
    """:func:`_seconds` before the profile's fitted ``op_final_scale``."""
    plan = _plan(op, profile, top_k, nodes, mode)
    if plan is None:
        return fallback()
    table, factor, _, features = plan
    if table is None:
        return fallback() if factor == 1.0 else fallback() * factor
    vec = table.vector(features)
    values = np.array([vec[-1]]) if swept is None else np.asarray(swept(), dtype=np.float64)
    secs, _, _ = _table_seconds(op, profile, table, vec[:-1], values.reshape(-1), top_k,
                                scope_of(nodes) == "inter", captured)
    return secs.reshape(values.shape) * factor


# --------------------------------------------------------------------------------------------
# Explain
# --------------------------------------------------------------------------------------------


def describe(op: Op, profile: HardwareProfile, *, tokens: float | None = None,
             top_k: int | None = None, nodes: np.ndarray | None = None,
             captured: bool = False, mode: A2AMode | None = None) -> dict[str, Any]:
    """How ``op`` is timed: ``{"method", "features", "table", "points", "ratio", "scaled"}``
    (``tokens``: the swept feature's value under this step's routing)."""
    plan = _plan(op, profile, top_k, nodes, mode)
    features = op_features(op, top_k)
    if features is not None and tokens is not None:
        features = {**features, "tokens": float(tokens)}
    out: dict[str, Any] = {"method": "roofline", "features": features}
    if plan is None:
        return out
    table, factor, chain, _ = plan
    if chain:
        out["scaled"] = [{"set": s, "factor": f, "source": src} for s, f, src in chain]
    if table is None:
        return out
    vec = table.vector(features)
    secs, method, nearest = _table_seconds(op, profile, table, vec[:-1], np.array([vec[-1]]),
                                           top_k, scope_of(nodes) == "inter", captured)
    out["method"] = METHODS[int(method[0])]
    out["table"] = table
    out["points"] = table.points_used(vec)
    if method[0] == EXTRAPOLATED:
        out["ratio"] = float(secs[0] / table.seconds[int(nearest[0])])
    return out


_COMPUTE_KEYS = ("peak_flops", "hbm_bandwidth", "efficiency.gemm_flops_fraction",
                 "efficiency.hbm_fraction", "efficiency.gemm_tile_m")
_STREAMING_KEYS = ("peak_flops", "hbm_bandwidth", "efficiency.hbm_fraction")
_EXCHANGE_KEYS = ("fabric", "nic_bandwidth_per_gpu", "efficiency.link_bandwidth_usable",
                  "efficiency.nic_bandwidth_usable", "efficiency.a2a_latency_s")
_COLLECTIVE_KEYS = ("fabric", "efficiency.link_bandwidth_usable",
                    "efficiency.collective_latency_s", "efficiency.collective_latency_graph_s")
#: the profile figures the roofline of each op kind uses (their ``sources`` entries are the
#: sources of a time the roofline gives)
ROOFLINE_SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    "gemm": _COMPUTE_KEYS, "grouped_gemm": _COMPUTE_KEYS, "lm_head": _COMPUTE_KEYS,
    "attention_prefill": _COMPUTE_KEYS,
    "attention_decode": (*_COMPUTE_KEYS, "efficiency.attention_decode_flops",
                         "efficiency.attention_split_tokens"),
    "dispatch": _EXCHANGE_KEYS, "combine": _EXCHANGE_KEYS,
    "all_reduce": _COLLECTIVE_KEYS, "all_gather": _COLLECTIVE_KEYS,
}


def roofline_sources(kind: str, profile: HardwareProfile) -> dict[str, Any]:
    """``{"profile:<key>": {"profile": <its file or name>, "key": ..., "source": ...}}`` for
    the profile figures ``kind``'s roofline reads, where the profile cites a source."""
    keys = ROOFLINE_SOURCE_KEYS.get(kind, _STREAMING_KEYS)
    cited = profile.sources
    return {f"profile:{k}": {"profile": profile.name, "key": k, "source": cited[k]}
            for k in keys if k in cited}


def explain(entries: list[tuple[Op, dict[str, Any]]], profile: HardwareProfile
            ) -> dict[str, Any]:
    """``kernel_sources``: per op kind, the methods used (op counts), the kernel set, the points
    used with their sources, the scalings, and the shapes outside every table with their ops."""
    kernels = profile.kernels
    sources = kernels.sources if kernels is not None else {}
    out: dict[str, Any] = {}
    for op, how in entries:
        kind = out.setdefault(op.kind, {"kernel_set": profile.kernel_set, "methods": {},
                                        "dtypes": {}, "points": {}, "sources": {},
                                        "outside": {}})
        # which number format each op of the plan computes in, and the table's quantisation
        fmt = op.dtype
        if how.get("table") is not None and how["table"].quant:
            fmt = f"{op.dtype} ({how['table'].quant})"
        kind["dtypes"][fmt] = kind["dtypes"].get(fmt, 0) + 1
        method = "scaled-set" if how.get("scaled") else how["method"]
        kind["methods"][method] = kind["methods"].get(method, 0) + 1
        if how.get("scaled"):
            kind.setdefault("base_methods", {})
            kind["base_methods"][how["method"]] = kind["base_methods"].get(how["method"], 0) + 1
            kind["scaled"] = how["scaled"]
            for s in how["scaled"]:
                kind["sources"][s["source"]] = _cite(sources, s["source"])
        table = how.get("table")
        if table is not None:
            for i in how["points"]:
                key = (table.where, i)
                if key not in kind["points"]:
                    point = table.point(i)
                    kind["points"][key] = {"table": table.where, **point}
                    kind["sources"][point["source"]] = _cite(sources, point["source"])
        if how["method"] in ("table-extrapolated", "roofline"):
            kind["sources"].update(roofline_sources(op.kind, profile))
        if how["method"] in ("table-extrapolated", "roofline") and how["features"] is not None:
            shape = tuple(sorted(how["features"].items()))
            entry = kind["outside"].setdefault(shape, {
                "features": dict(how["features"]), "method": how["method"], "ops": [],
                "count": 0})
            entry["count"] += 1
            if len(entry["ops"]) < _OUTSIDE_IDS:
                entry["ops"].append(op.id)
            if "ratio" in how:
                entry["roofline_ratio"] = how["ratio"]
                entry["nearest"] = kind["points"][(table.where, how["points"][0])]
    ordered = {}
    for name in OP_KINDS:
        if name in out:
            kind = out[name]
            methods = kind["methods"]
            kind["method"] = next(iter(methods)) if len(methods) == 1 else "mixed"
            kind["points"] = list(kind["points"].values())
            kind["outside"] = list(kind["outside"].values())
            ordered[name] = kind
    return ordered


def _cite(sources: Any, sid: str) -> dict[str, Any]:
    src = sources.get(sid)
    return src.to_json() if src is not None else {"id": sid}
