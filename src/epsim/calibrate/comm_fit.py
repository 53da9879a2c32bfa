"""Fitting the EP exchange (dispatch / combine) of a hardware profile: the all-to-all benchmark's
table and the exchanges of the ranks sweep's decode steps (pure numpy/pandas; no torch).

The model fitted is the simulator's own (``sim/hardware/profile.py``):

    dispatch / combine:     t = latency[kind][world] + link_bytes / W
    issuing the exchange:   holds the host host[kind][world] (+ fraction * compute since the
                            previous exchange, for a dispatch)

``fit_exchange`` picks one of the models of ``calibrate/exchange_fits.py`` (``fit_in_step``,
``fit_comm`` alone, or ``fit_comm`` over ``last_s`` plus ``fit_straggler``); ``fit_comm`` is a
non-negative least squares over the exchange rows; ``fit_host_block`` and ``fit_host_in_step``
read how long issuing held the host. The solvers are ``calibrate/fit.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from epsim.model.errors import EpsimError

from .exchange_fits import DEFAULT_EXCHANGE_FIT, EXCHANGE_FITS
from .fit import ls_overhead_scale, nnls, step_share_s


@dataclass(frozen=True)
class CommFit:
    """The fitted exchange model: ``t = latency[kind][world] + link_bytes / bandwidth``.

    latency_s: ``{"dispatch" | "combine": {world: seconds}}``. Example (gloo, 2 shared cores):
        ``{"dispatch": {2: 3.0e-3, 4: 9.1e-3}, "combine": {2: 1.1e-3, 4: 4.8e-3}}``.
    bandwidth: bytes/s of the busiest link (bytes as the op graph counts them).
    rel_err: median |relative error| over the rows.
    """

    latency_s: dict[str, dict[int, float]]
    bandwidth: float
    rel_err: float = 0.0

    def predict(self, df: pd.DataFrame) -> np.ndarray:
        lat = np.array([self.latency_s[k][int(w)] for k, w in zip(df["kind"], df["world"],
                                                                   strict=True)])
        return lat + df["link_bytes"].to_numpy(dtype=float) / self.bandwidth



def fit_comm(df: pd.DataFrame) -> CommFit:
    """Fit the exchange model to rows with ``kind`` (dispatch/combine), ``world``,
    ``link_bytes``, ``time_s``: one latency per (kind, world) and one shared bandwidth, by
    non-negative least squares on relative errors."""
    if df.empty or not {"dispatch", "combine"} <= set(df["kind"]):
        raise EpsimError("the all-to-all table needs dispatch and combine rows")
    t = df["time_s"].to_numpy(dtype=float)
    w = 1.0 / t
    groups = sorted({(k, int(x)) for k, x in zip(df["kind"], df["world"], strict=True)})
    cols = [((df["kind"] == k) & (df["world"] == x)).to_numpy(dtype=float) for k, x in groups]
    link = df["link_bytes"].to_numpy(dtype=float)
    scale = max(float(np.max(link * w)), 1e-300)  # keep the columns of order one
    A = np.stack([*cols, link / scale], axis=1) * w[:, None]
    A[:, -1] = link * w / scale
    x = nnls(A, np.ones_like(t))
    inv_bw = x[-1] / scale
    # a zero inverse bandwidth means the bytes did not show: cap the link at 1 TB/s
    bandwidth = float(1.0 / inv_bw) if inv_bw > 1e-12 else 1e12
    latency: dict[str, dict[int, float]] = {}
    for (k, world), value in zip(groups, x[:-1], strict=True):
        latency.setdefault(k, {})[world] = float(value)
    fit = CommFit(latency, bandwidth)
    err = np.abs(fit.predict(df) - t) / t
    return CommFit(latency, bandwidth, float(np.median(err)))


def fit_host_block(df: pd.DataFrame) -> dict[str, dict[int, float]]:
    """``{dispatch|combine: {world: seconds}}``: how long issuing an exchange holds the host, at
    decode's message sizes: per (kind, world) the fixed part of a non-negative line through the
    rows' ``host_s`` over ``link_bytes`` (relative errors). The size-dependent part (the call's
    own row gathering) is left out: at the few kilobytes of a decode step it is a few percent.

    Args:
        df: the all-to-all rows (``kind``, ``world``, ``link_bytes``, ``host_s``); rows without
            ``host_s`` (tables of an older epsim) give an empty result.
    """
    if df.empty or "host_s" not in df or df["host_s"].isna().all():
        return {}
    out: dict[str, dict[int, float]] = {}
    for (kind, world), sub in df.dropna(subset=["host_s"]).groupby(["kind", "world"]):
        t = np.maximum(sub["host_s"].to_numpy(dtype=float), 1e-9)
        a, _, _ = ls_overhead_scale(sub["link_bytes"].to_numpy(dtype=float), t, None)
        out.setdefault(str(kind), {})[int(world)] = max(a, 1e-9)
    return out


def fit_straggler(ranks: pd.DataFrame) -> tuple[dict[int, float], dict[int, float]]:
    """How long after the average rank the last one reaches an exchange in a decode step of
    ``world`` local ranks: ``straggler = fixed[world] + fraction[world] * segment`` (the ranks
    sweep's ``straggler_s`` over its ``segment_s``, the compute since the previous exchange), a
    non-negative fit on relative errors over every exchange row of that world size.

    Returns:
        ``(fixed, fraction)``: ``{world: seconds}`` and ``{world: fraction}``; empty without the
        columns (older tables) or without multi-rank exchanges.
    """
    if ranks is None or ranks.empty or not {"straggler_s", "segment_s"} <= set(ranks):
        return {}, {}
    rows = ranks.dropna(subset=["straggler_s", "segment_s"])
    rows = rows[rows["kind"].isin(("dispatch", "combine")) & (rows["world"] > 1)]
    fixed: dict[int, float] = {}
    fraction: dict[int, float] = {}
    for world, sub in rows.groupby("world"):
        t = np.maximum(sub["straggler_s"].to_numpy(dtype=float), 1e-7)
        a, k, _ = ls_overhead_scale(sub["segment_s"].to_numpy(dtype=float), t, None)
        fixed[int(world)], fraction[int(world)] = a, k
    return fixed, fraction


def fit_host_in_step(ranks: pd.DataFrame | None
                     ) -> tuple[dict[str, dict[int, float]], dict[int, float]]:
    """How long issuing an exchange holds the host in the ranks sweep's decode steps (its
    ``host_s``): a dispatch's blocking count exchange is a meeting of every rank, so it lasts
    ``fixed[world] + fraction[world] * segment`` (``segment_s``: the compute since the previous
    exchange, over which time-sliced ranks drift apart; a non-negative fit on relative errors
    per world size); a combine's asynchronous call is the rank's own: the median over its rows
    per world.

    Returns:
        ``({"dispatch": {world: fixed}, "combine": {world: seconds}}, {world: fraction})``;
        empty without the column (tables of an older epsim) or without multi-rank exchanges.
    """
    if ranks is None or ranks.empty or not {"host_s", "segment_s"} <= set(ranks):
        return {}, {}
    rows = ranks.dropna(subset=["host_s", "segment_s"])
    rows = rows[rows["world"] > 1]
    held: dict[str, dict[int, float]] = {}
    fraction: dict[int, float] = {}
    for world, sub in rows[rows["kind"] == "dispatch"].groupby("world"):
        t = np.maximum(sub["host_s"].to_numpy(dtype=float), 1e-7)
        a, k, _ = ls_overhead_scale(sub["segment_s"].to_numpy(dtype=float), t, None)
        held.setdefault("dispatch", {})[int(world)] = a
        fraction[int(world)] = k
    for world, sub in rows[rows["kind"] == "combine"].groupby("world"):
        held.setdefault("combine", {})[int(world)] = float(sub["host_s"].median())
    return held, fraction


def fit_exchange(a2a: pd.DataFrame, ranks: pd.DataFrame | None,
                 method: str = DEFAULT_EXCHANGE_FIT) -> tuple[CommFit, dict]:
    """The exchange model of ``method`` (``calibrate/exchange_fits.py``).

    ``"slowest"``: the slowest rank's time (``time_s``) per kind and world, which holds the
    ranks' spread after the benchmark's short compute. ``"in-step"``: the exchanges of the
    ranks sweep's decode steps (:func:`fit_in_step`). ``"last-plus-straggler"``: the latency the
    last rank to arrive sees (the all-to-all table's ``last_s``) plus the straggler's fixed part
    (:func:`fit_straggler`), per kind and world; the straggler's part that grows with the compute
    between exchanges is the profile's ``exchange_straggler_fraction``; without the columns
    (tables of an older epsim), the slowest rank's time. One bandwidth either way.

    Returns:
        The fit (its latencies include the straggler's fixed part) and ``{"latency_s",
        "straggler_fixed_s", "straggler_fraction"}``, for the profile's record (empty: no split).
    """
    if method not in EXCHANGE_FITS:
        raise EpsimError(f"exchange fit must be one of {', '.join(EXCHANGE_FITS)}, got {method!r}")
    if method == "slowest":
        return fit_comm(a2a), {}
    if method == "in-step":
        return fit_in_step(a2a, ranks), {}
    fixed, fraction = fit_straggler(ranks)
    if not fixed or "last_s" not in a2a or a2a["last_s"].isna().any():
        return fit_comm(a2a), {}
    pure = fit_comm(a2a.assign(time_s=a2a["last_s"]))
    latency = {k: {w: v + fixed.get(w, 0.0) for w, v in t.items()}
               for k, t in pure.latency_s.items()}
    return (CommFit(latency, pure.bandwidth, pure.rel_err),
            {"latency_s": pure.latency_s, "straggler_fixed_s": fixed,
             "straggler_fraction": fraction})


def fit_in_step(a2a: pd.DataFrame, ranks: pd.DataFrame | None) -> CommFit:
    """The exchange model measured where validation measures it: per (kind, world), the median
    over the ranks sweep's exchange ops of each one's share of a median step
    (:func:`step_share_s`; decode steps of the calibration shapes on ``world`` local ranks, from
    each rank's issue to the end of its wait, so the ranks' spread at every meeting is in it),
    the all-to-all benchmark's fitted bandwidth; a (kind, world) the ranks sweep has no exchange
    of keeps the benchmark's latency.

    The bytes of those decode-sized exchanges are in their times and are charged again as
    ``link_bytes / W`` (docs/validation.md gives the size of that double count).
    """
    bench = fit_comm(a2a)
    latency = {k: dict(t) for k, t in bench.latency_s.items()}
    if ranks is not None and not ranks.empty:
        rows = ranks[ranks["kind"].isin(["dispatch", "combine"]) & (ranks["world"] > 1)]
        rows = rows.assign(time_s=step_share_s(rows))
        for (kind, world), g in rows.groupby(["kind", "world"]):
            latency.setdefault(str(kind), {})[int(world)] = float(g["time_s"].median())
    fit = CommFit(latency, bench.bandwidth)
    err = np.abs(fit.predict(a2a) - a2a["time_s"].to_numpy(dtype=float)) \
        / a2a["time_s"].to_numpy(dtype=float)
    return CommFit(latency, bench.bandwidth, float(np.median(err)))


