"""Op times from a profile's measured kernel tables (``epsim.sim.hardware.kernel_sets``), and how they were got.

Where the selected kernel set (``HardwareProfile.with_kernels``) has a table for an op's kind,
dtype and scope, the op's time is the table's at the op's features (exact, interpolated, or the
nearest point scaled by the kind's roofline ratio), divided by the speedups of the sets it was
scaled through; elsewhere the roofline of the op's family (``sim.step.cost.registry``, times those
speedups). Without a kernel set the roofline alone, bit for bit. Every timer takes the op and
its step's ``CostContext`` (``sim.step.cost.context``: the profile, top-k, deployment, nodes).

What a table of each op kind is looked up at (its features, dtype and scope), the kind's
roofline at other features and the profile figures it reads are the kind's entry in
``sim.step.cost.registry.KIND_COSTING`` (its family's ``COSTING``); this module times ops with them and reports how
(``describe``, ``explain``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from epsim.model.opgraph import OP_KINDS, Op
from epsim.sim.hardware.kernel_sets import EXTRAPOLATED, METHODS, Table
from epsim.sim.hardware.profile import HardwareProfile
from epsim.sim.hardware.table_guard import point_efficiency

from .context import CostContext, as_context
from .registry import (
    feature_roofline,
    kernel_dtype,
    op_features,
    roofline_op_time,
    roofline_sources,
    table_scope,
)
from .roofline import final_scaled

_OUTSIDE_IDS = 8  # op ids listed per shape outside every table
#: swept values from which a lookup is made once per distinct value (a step's fused-MoE token
#: counts repeat: 928 values of DeepSeek-R1 on 8 GPUs hold about 190 distinct ones)
_DISTINCT_FROM = 256


def _plan(op: Op, ctx: CostContext):
    """``(table or None, factor, chain, features)`` under the selected set; None: no set. The
    step's deployment (``ctx.mode`` / ``ctx.layout``) are ``kernel_sets``' selectors."""
    profile = ctx.profile
    kernels = profile.kernels
    if kernels is None or profile.active_kernels is None:
        return None
    mode = ctx.mode.name if ctx.mode is not None else ""
    table, factor, chain = kernels.resolve(profile.kernel_set, op.kind, kernel_dtype(op),
                                           table_scope(op, ctx), mode, ctx.layout)
    features = op_features(op, ctx.top_k) if table is not None else None
    if features is None or not table.describes(features):
        table, features = None, None
    return table, factor, chain, features


# --------------------------------------------------------------------------------------------
# Times
# --------------------------------------------------------------------------------------------


def _table_seconds(op: Op, ctx: CostContext, table: Table, fixed: tuple[float, ...],
                   values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seconds, method, nearest)`` at each of ``values`` (``[n]``), extrapolations scaled by
    the roofline's ratio. Every step is elementwise (a value's answer does not depend on the
    others), so repeated values are looked up once, with equal results."""
    if len(values) >= _DISTINCT_FROM:
        distinct, where = np.unique(values, return_inverse=True)
        if len(distinct) < len(values):
            secs, method, nearest = _table_seconds(op, ctx, table, fixed, distinct)
            return secs[where], method[where], nearest[where]
    if len(values) == 1:  # one op's own features: the scalar path, equal results
        return _table_seconds_one(op, ctx, table, fixed, float(values[0]))
    method, secs, nearest = table.locate(fixed, values)
    out = method == EXTRAPOLATED
    if out.any():
        q = np.column_stack([np.tile(np.asarray(fixed, dtype=np.float64), (int(out.sum()), 1)),
                             values[out]])
        p = table.x[nearest[out]]
        both = feature_roofline(op, ctx, np.vstack([q, p]))
        rq, rp = both[:len(q)], both[len(q):]
        secs[out] *= np.where(rp > 0, rq / np.where(rp > 0, rp, 1.0), 1.0)
    return secs, method, nearest


def _table_seconds_one(op: Op, ctx: CostContext, table: Table, fixed: tuple[float, ...],
                       value: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_table_seconds` of one value: the table's scalar lookup and, outside it, one
    roofline call for the query and its nearest point (the same float operations)."""
    how, secs, near = table.locate_one(fixed, value)
    if how == EXTRAPOLATED:
        rq, rp = feature_roofline(op, ctx, np.array([(*fixed, value), table.x[near]])).tolist()
        secs = secs * (rq / rp if rp > 0 else 1.0)
    return np.array([secs]), np.array([how]), np.array([near])


def op_seconds(op: Op, ctx: CostContext, fallback: Callable[[], float]) -> float:
    """``op``'s seconds under the selected kernel set in ``ctx`` (its deployment picks the
    table); ``fallback()`` is its roofline time (returned as is where no table and no speedup
    applies)."""
    secs = _seconds(op, ctx, None, fallback)
    return float(secs[0]) if isinstance(secs, np.ndarray) else float(secs)


def op_time(op: Op, where: CostContext | HardwareProfile) -> float:
    """Seconds one op takes (no launch cost, no interference): the selected kernel set's table
    where it has one, else the roofline (``roofline_op_time``). ``where``: the step's context
    (``CostContext``: top-k, deployment, the group's nodes), or a profile alone for an op on its
    own (no top-k, no deployment, one node, eager)."""
    ctx = as_context(where)
    return op_seconds(op, ctx, lambda: roofline_op_time(op, ctx))


def answered_by_table(op: Op, ctx: CostContext) -> bool:
    """Whether a table of the selected set times ``op``: its routed seconds are then a function
    of the swept value alone (no fallback, whose time may read more: per-expert counts)."""
    plan = _plan(op, ctx)
    return plan is not None and plan[0] is not None


def routed_seconds(op: Op, ctx: CostContext, swept: Callable[[], np.ndarray],
                   fallback: Callable[[], np.ndarray]) -> np.ndarray:
    """A routed op's seconds at many values of its swept feature (``tokens``: ``swept()``, any
    shape) under the selected kernel set; ``fallback()``: the roofline's, same shape."""
    return _seconds(op, ctx, swept, fallback)


def _seconds(op: Op, ctx: CostContext, swept: Callable[[], np.ndarray] | None,
             fallback: Callable[[], Any]) -> Any:
    """The table's seconds at the op's own features (``swept`` None: ``[1]``) or at every value
    ``swept()`` gives its swept feature, times the set's speedups; ``fallback()`` (times them)
    where the set has no table for the op; then times the profile's fitted ``op_final_scale``
    (``final_scaled``: every timed op passes here once)."""
    return final_scaled(op, ctx.profile, _unscaled(op, ctx, swept, fallback))


def _unscaled(op: Op, ctx: CostContext, swept: Callable[[], np.ndarray] | None,
              fallback: Callable[[], Any]) -> Any:
    """:func:`_seconds` before the profile's fitted ``op_final_scale``."""
    plan = _plan(op, ctx)
    if plan is None:
        return fallback()
    table, factor, _, features = plan
    if table is None:
        return fallback() if factor == 1.0 else fallback() * factor
    vec = table.vector(features)
    values = np.array([vec[-1]]) if swept is None else np.asarray(swept(), dtype=np.float64)
    secs, _, _ = _table_seconds(op, ctx, table, vec[:-1], values.reshape(-1))
    return secs.reshape(values.shape) * factor


# --------------------------------------------------------------------------------------------
# Explain
# --------------------------------------------------------------------------------------------


def describe(op: Op, where: CostContext | HardwareProfile, *, tokens: float | None = None
             ) -> dict[str, Any]:
    """How ``op`` is timed in ``where`` (as :func:`op_time`'s): ``{"method", "features",
    "table", "points", "ratio", "scaled"}`` (``tokens``: the swept feature's value under this
    step's routing)."""
    ctx = as_context(where)
    plan = _plan(op, ctx)
    features = op_features(op, ctx.top_k)
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
    secs, method, nearest = _table_seconds(op, ctx, table, vec[:-1], np.array([vec[-1]]))
    out["method"] = METHODS[int(method[0])]
    out["table"] = table
    out["points"] = table.points_used(vec)
    if method[0] == EXTRAPOLATED:
        out["ratio"] = float(secs[0] / table.seconds[int(nearest[0])])
    return out


def explain(entries: list[tuple[Op, dict[str, Any]]], profile: HardwareProfile
            ) -> dict[str, Any]:
    """``kernel_sources``: per op kind, the methods used (op counts), the kernel set, the tables
    chosen (``tables``: where each sits, the deployment it measured, its note, the ops it
    timed), the points used with their sources, the scalings, and the shapes outside every
    table with their ops."""
    kernels = profile.kernels
    sources = kernels.sources if kernels is not None else {}
    out: dict[str, Any] = {}
    for op, how in entries:
        kind = out.setdefault(op.kind, {"kernel_set": profile.kernel_set, "methods": {},
                                        "dtypes": {}, "tables": {}, "points": {},
                                        "sources": {}, "outside": {}})
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
            chosen = kind["tables"].setdefault(table.where, {
                "table": table.where, "deployment": table.deployment or "any",
                "mode": table.mode, "layout": table.layout, "note": table.note, "ops": 0})
            chosen["ops"] += 1
            for i in how["points"]:
                key = (table.where, i)
                if key not in kind["points"]:
                    point = table.point(i)
                    # the point's implied efficiency against the roofline (table_guard)
                    kind["points"][key] = {"table": table.where, **point,
                                           **(point_efficiency(table, i, profile.roof) or {})}
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
            kind["tables"] = list(kind["tables"].values())
            kind["points"] = list(kind["points"].values())
            kind["outside"] = list(kind["outside"].values())
            ordered[name] = kind
    return ordered


def _cite(sources: Any, sid: str) -> dict[str, Any]:
    src = sources.get(sid)
    return src.to_json() if src is not None else {"id": sid}
