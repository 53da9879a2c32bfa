"""Fitting a hardware profile's compute figures to microbenchmark tables (pure numpy/pandas;
no torch). The exchange's figures are fitted in ``calibrate/comm_fit.py``, with the solvers here.

The model fitted is the simulator's own (``sim/step/cost/roofline.py``: the same ``roof`` function,
``sim/hardware/profile.py``):

    compute op of kind k:   t = overhead[k] + scale[k] * max(flops / F, bytes / B)
                            (``scale["gemm"] = 1``: GEMMs define the roofline F and B)
    ranks sharing cores:    a compute op takes slowdown[ranks] times as long
    exchange in flight:     compute runs at 1 - s of its speed

``fit_compute`` searches F and B on a log grid (then a finer one around the best) and, for each
(F, B), solves every kind's non-negative (overhead, scale) by weighted least squares on relative
errors; ``fit_rank_slowdown`` compares the same ops on W ranks and on one;
``fit_comm_slowdown`` reads the contention rows. ``tests/calibrate/test_calibrate_fit.py`` checks that each
recovers known parameters from synthetic tables.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from epsim.model.errors import EpsimError
from epsim.sim.step.cost import roof

#: the kind whose scale is fixed to 1: its rows (skinny and square GEMMs) identify F and B
ROOFLINE_KIND = "gemm"
COMPUTE_KINDS = ("gemm", "gemm.batched", "grouped_gemm", "attention_decode", "attention_prefill", "norm", "rope",
                 "router", "elementwise", "embedding", "lm_head", "sample")


@dataclass(frozen=True)
class ComputeFit:
    """The fitted compute model.

    flops: F, achievable FLOP/s of the roofline. Example: 1.5e11 (one CPU core, fp32).
    bandwidth: B, achievable bytes/s of the roofline (bytes as the op graph counts them).
    overhead_s: ``{kind: seconds}`` fixed cost per op. Example: ``{"norm": 5.1e-5}``.
    scale: ``{kind: factor}`` on the roofline time (gemm: 1); ``"sum"``: on the FLOP term.
    bytes_scale: ``"sum"`` only: ``{kind: factor}`` on the bytes term (gemm: 1).
    mode: ``"max"`` (t = overhead + scale * max(flops/F, bytes/B)) or ``"sum"`` (t = overhead +
        scale * flops/F + bytes_scale * bytes/B).
    rel_err: ``{kind: median |relative error|}`` of the fit on its own rows.
    rows: ``{kind: rows fitted}``.
    """

    flops: float
    bandwidth: float
    overhead_s: dict[str, float]
    scale: dict[str, float]
    bytes_scale: dict[str, float] = field(default_factory=dict)
    mode: str = "max"
    rel_err: dict[str, float] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def predict(self, df: pd.DataFrame) -> np.ndarray:
        """``[rows]`` seconds for a table with ``kind``, ``flops``, ``bytes`` columns."""
        over = df["kind"].map(lambda k: self.overhead_s.get(k, 0.0)).to_numpy(dtype=float)
        scale = df["kind"].map(lambda k: self.scale.get(k, 1.0)).to_numpy(dtype=float)
        if self.mode == "sum":
            bscale = df["kind"].map(lambda k: self.bytes_scale.get(k, 1.0)).to_numpy(dtype=float)
            return over + roof(df["flops"].to_numpy(dtype=float),
                               df["bytes"].to_numpy(dtype=float), self.flops, self.bandwidth,
                               "sum", scale, bscale)
        return over + scale * roofline(df, self.flops, self.bandwidth)


def with_classes(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``kind`` replaced by the op class the simulator keys fitted figures on
    (``epsim.sim.step.cost.roofline.op_class``: batched GEMMs are ``gemm.batched``)."""
    if "gemm_batch" not in df or df.empty:
        return df
    batched = (df["kind"] == "gemm") & (df["gemm_batch"].fillna(1) > 1)
    out = df.copy()
    out.loc[batched, "kind"] = "gemm.batched"
    return out


def step_share_s(rows: pd.DataFrame) -> pd.Series:
    """What each of the ranks sweep's rows adds to a median step, in seconds: ``step_s`` (the
    op's median scaled so that its configuration's ops sum to the steps' median,
    ``epsim.calibrate.micro.step_scales``: ranks time-sliced on shared cores are preempted in a
    few long samples, which a step holds and an op's median drops) where the table has it, else
    the median ``time_s`` (tables of an older epsim)."""
    if "step_s" not in rows:
        return rows["time_s"]
    return rows["step_s"].where(rows["step_s"].notna(), rows["time_s"])


def roofline(df: pd.DataFrame, flops_per_s: float, bytes_per_s: float) -> np.ndarray:
    """``[rows]`` max(flops / F, bytes / B): the cost model's roofline (tile 1, occupancy 1),
    the simulator's ``roof``."""
    return roof(df["flops"].to_numpy(dtype=float), df["bytes"].to_numpy(dtype=float),
                flops_per_s, bytes_per_s)


def ls_overhead_scale(x: np.ndarray, t: np.ndarray, fixed_scale: float | None
                       ) -> tuple[float, float, float]:
    """Non-negative (a, s) minimising sum(((a + s x) - t) / t)^2; returns (a, s, cost).
    ``fixed_scale``: s is given, a alone is fitted. The line every per-kind overhead and every
    fixed part of an exchange's time (``calibrate/comm_fit.py``) is read from."""
    w = 1.0 / t
    if fixed_scale is not None:
        s = fixed_scale
        # weighted mean of the residual, clamped at 0
        a = max(0.0, float(np.sum(w * w * (t - s * x)) / np.sum(w * w)))
        return a, s, float(np.sum((w * (a + s * x - t)) ** 2))
    best = None
    A = np.stack([w, w * x], axis=1)
    b = np.ones_like(t)
    candidates = []
    sol, *_ = np.linalg.lstsq(A, b, rcond=None)
    candidates.append((float(sol[0]), float(sol[1])))
    # the boundary solutions of the non-negative problem
    candidates.append((max(0.0, float(np.sum(w * w * t) / np.sum(w * w))), 0.0))
    xs = np.sum((w * x) ** 2)
    candidates.append((0.0, max(0.0, float(np.sum(w * w * x * t) / xs)) if xs > 0 else 0.0))
    for a, s in candidates:
        if a < 0 or s < 0:
            continue
        cost = float(np.sum((w * (a + s * x - t)) ** 2))
        if best is None or cost < best[2]:
            best = (a, s, cost)
    assert best is not None
    return best


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of unknowns: the best feasible solution over
    every subset of free variables (exact for ``A.shape[1]`` up to ~10)."""
    n = A.shape[1]
    best, best_cost = np.zeros(n), float(np.sum(b ** 2))
    for r in range(1, n + 1):
        for subset in itertools.combinations(range(n), r):
            cols = list(subset)
            sol, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
            if (sol < 0).any():
                continue
            x = np.zeros(n)
            x[cols] = sol
            cost = float(np.sum((A @ x - b) ** 2))
            if cost < best_cost:
                best, best_cost = x, cost
    return best


def _fit_at(df: pd.DataFrame, groups: dict[str, np.ndarray], flops_per_s: float,
            bytes_per_s: float) -> tuple[float, dict[str, tuple[float, float]]]:
    roof = roofline(df, flops_per_s, bytes_per_s)
    t = df["time_s"].to_numpy(dtype=float)
    total = 0.0
    params = {}
    for kind, idx in groups.items():
        a, s, cost = ls_overhead_scale(roof[idx], t[idx],
                                        1.0 if kind == ROOFLINE_KIND else None)
        params[kind] = (a, s)
        total += cost
    return total, params


def fit_compute(df: pd.DataFrame, flops_range: tuple[float, float] = (1e8, 1e13),
                bytes_range: tuple[float, float] = (1e7, 1e13), points: int = 41) -> ComputeFit:
    """Fit F, B and every kind's (overhead, scale) to timed op rows.

    Args:
        df: rows with ``kind``, ``flops``, ``bytes``, ``time_s`` (seconds, > 0); must contain
            ``gemm`` rows.
        flops_range / bytes_range: where F and B are searched (log grid of ``points``, then a
            grid 8x finer around the best point).

    Returns:
        A :class:`ComputeFit`.
    """
    df = with_classes(df)
    df = df[df["kind"].isin(COMPUTE_KINDS) & (df["time_s"] > 0)].reset_index(drop=True)
    if not (df["kind"] == ROOFLINE_KIND).any():
        raise EpsimError("the op table has no gemm rows: the roofline cannot be fitted")
    groups = {k: np.flatnonzero((df["kind"] == k).to_numpy()) for k in sorted(set(df["kind"]))}
    log_f = np.linspace(np.log10(flops_range[0]), np.log10(flops_range[1]), points)
    log_b = np.linspace(np.log10(bytes_range[0]), np.log10(bytes_range[1]), points)
    best: tuple[float, float, float] | None = None
    for _ in range(2):
        for lf, lb in itertools.product(log_f, log_b):
            cost, _ = _fit_at(df, groups, 10 ** lf, 10 ** lb)
            if best is None or cost < best[0]:
                best = (cost, lf, lb)
        assert best is not None
        # a finer grid around the best point
        step_f = (log_f[1] - log_f[0]) if len(log_f) > 1 else 0.1
        step_b = (log_b[1] - log_b[0]) if len(log_b) > 1 else 0.1
        log_f = np.linspace(best[1] - step_f, best[1] + step_f, 17)
        log_b = np.linspace(best[2] - step_b, best[2] + step_b, 17)
    assert best is not None
    flops_per_s, bytes_per_s = 10 ** best[1], 10 ** best[2]
    _, params = _fit_at(df, groups, flops_per_s, bytes_per_s)
    fit = ComputeFit(flops=flops_per_s, bandwidth=bytes_per_s,
                     overhead_s={k: a for k, (a, _) in params.items()},
                     scale={k: s for k, (_, s) in params.items() if k != ROOFLINE_KIND})
    pred = fit.predict(df)
    err = np.abs(pred - df["time_s"].to_numpy()) / df["time_s"].to_numpy()
    rel = {k: float(np.median(err[idx])) for k, idx in groups.items()}
    return ComputeFit(fit.flops, fit.bandwidth, fit.overhead_s, fit.scale, rel_err=rel,
                      rows={k: len(idx) for k, idx in groups.items()})


def fit_compute_sum(df: pd.DataFrame) -> ComputeFit:
    """Fit the additive model ``t = a[k] + c_f[k] * flops + c_b[k] * bytes`` per kind by
    non-negative least squares on relative errors; the gemm rows' ``1 / c_f`` and ``1 / c_b``
    are F and B, every kind's factors are relative to them.

    Args:
        df: rows with ``kind``, ``flops``, ``bytes``, ``time_s``; must contain ``gemm`` rows.

    Returns:
        A :class:`ComputeFit` with ``mode="sum"``.
    """
    df = with_classes(df)
    df = df[df["kind"].isin(COMPUTE_KINDS) & (df["time_s"] > 0)].reset_index(drop=True)
    if not (df["kind"] == ROOFLINE_KIND).any():
        raise EpsimError("the op table has no gemm rows: the roofline cannot be fitted")
    coef: dict[str, np.ndarray] = {}
    groups = {k: np.flatnonzero((df["kind"] == k).to_numpy()) for k in sorted(set(df["kind"]))}
    for kind, idx in groups.items():
        sub = df.iloc[idx]
        t = sub["time_s"].to_numpy(dtype=float)
        w = 1.0 / t
        # columns scaled to order one so the subset solves are well conditioned
        cols = [np.ones_like(t), sub["flops"].to_numpy(dtype=float),
                sub["bytes"].to_numpy(dtype=float)]
        norms = np.array([max(float(np.max(np.abs(c * w))), 1e-300) for c in cols])
        A = np.stack([c * w / n for c, n in zip(cols, norms, strict=True)], axis=1)
        coef[kind] = nnls(A, np.ones_like(t)) / norms
    g = coef[ROOFLINE_KIND]
    # a GEMM table without memory-bound (or compute-bound) rows cannot show that term: fall
    # back to the fastest rate seen so the term stays negligible rather than infinite
    gemm = df.iloc[groups[ROOFLINE_KIND]]
    flops_per_s = 1.0 / g[1] if g[1] > 0 else float((gemm["flops"] / gemm["time_s"]).max())
    bytes_per_s = 1.0 / g[2] if g[2] > 0 else float((gemm["bytes"] / gemm["time_s"]).max())
    fit = ComputeFit(
        flops=flops_per_s, bandwidth=bytes_per_s,
        overhead_s={k: float(c[0]) for k, c in coef.items()},
        scale={k: float(c[1] * flops_per_s) for k, c in coef.items() if k != ROOFLINE_KIND},
        bytes_scale={k: float(c[2] * bytes_per_s) for k, c in coef.items()
                     if k != ROOFLINE_KIND},
        mode="sum")
    err = np.abs(fit.predict(df) - df["time_s"].to_numpy()) / df["time_s"].to_numpy()
    rel = {k: float(np.median(err[idx])) for k, idx in groups.items()}
    return ComputeFit(fit.flops, fit.bandwidth, fit.overhead_s, fit.scale, fit.bytes_scale,
                      "sum", rel, {k: len(idx) for k, idx in groups.items()})


def fit_rank_slowdown(single: pd.DataFrame, ranks: pd.DataFrame,
                      skip: Sequence[str] = ("grouped_gemm", "dispatch", "combine")
                      ) -> dict[int, float]:
    """``{world: factor}``: the ops' summed time on ``world`` local ranks (each op's time in a
    step, :func:`step_share_s`: its preemptions included) over their summed time in the
    single-process op sweep (medians; world 1 included: the launcher's own conditions).

    Anchoring every world size, 1 included, to the op sweep folds any difference between the
    sweep's moment and the launched runs' (the machine's background load) into the factors, which
    are measured the way validation runs are.

    Args:
        single: op rows of the op sweep (``shape``, ``batch``, ``context``, ``op_id``,
            ``time_s``; DBO rows are ignored).
        ranks: the same configurations on ``world`` ranks (plus a ``world`` column).
        skip: kinds whose work differs between one rank and EP ranks (the routed experts get
            other tokens; exchanges exist only with peers).
    """
    keys = ["shape", "batch", "context", "op_id"]
    one = single[~single["dbo"].astype(bool)] if "dbo" in single else single
    ranks = ranks.assign(time_s=step_share_s(ranks))
    merged = ranks[~ranks["kind"].isin(skip)].merge(one[keys + ["time_s"]], on=keys,
                                                    suffixes=("", "_single"))
    if merged.empty:
        raise EpsimError("no op was timed both alone and on several ranks")
    # time-weighted: a long op is more likely to be preempted, and long ops make the step
    out = {}
    for w in sorted(set(merged["world"])):
        sel = merged[merged["world"] == w]
        out[int(w)] = float(sel["time_s"].sum() / sel["time_s_single"].sum())
    return out


def fit_rank_slowdown_by_kind(single: pd.DataFrame, ranks: pd.DataFrame,
                              skip: Sequence[str] = ("grouped_gemm", "dispatch", "combine"),
                              min_rows: int = 3) -> dict[str, dict[int, float]]:
    """``{op class: {world: factor}}``: :func:`fit_rank_slowdown` per op class (classes with at
    least ``min_rows`` matched ops at every world size). Short ops and long ones are slowed
    differently when ranks share cores (long ones are the ones preempted)."""
    keys = ["shape", "batch", "context", "op_id"]
    one = with_classes(single)
    one = one[~one["dbo"].astype(bool)] if "dbo" in one else one
    # the op class comes from the op sweep's rows (they carry the GEMM batch)
    rows = ranks[~ranks["kind"].isin(skip)].drop(columns=["kind"]).merge(
        one[keys + ["kind"]], on=keys)
    worlds = set(ranks["world"])
    out: dict[str, dict[int, float]] = {}
    for kind in sorted(set(rows["kind"])):
        sub = rows[rows["kind"] == kind]
        counts = sub.groupby("world").size()
        if set(counts.index) != worlds or counts.min() < min_rows:
            continue
        out[kind] = fit_rank_slowdown(one, sub, skip)
    return out


def fit_rank_skew(ranks: pd.DataFrame) -> dict[int, float]:
    """``{world: seconds}``: per world size above 1, the median over the ranks sweep's
    configurations of ``rank_skew_s`` (the slowest rank's step beyond the ranks' mean); empty
    for a table without the column (one written before it was measured)."""
    if ranks.empty or "rank_skew_s" not in ranks:
        return {}
    rows = ranks[(ranks["world"] > 1) & ranks["rank_skew_s"].notna()]
    configs = rows.drop_duplicates(["shape", "world", "batch", "context"])
    return {int(w): max(0.0, float(g["rank_skew_s"].median()))
            for w, g in configs.groupby("world")}


def fit_comm_slowdown_by_world(contention: pd.DataFrame, floor: float = 0.01,
                               cap: float = 0.9) -> dict[int, float]:
    """``{world: s}``: :func:`fit_comm_slowdown` at each world size of the contention table
    (``world``, ``probe_s``, ``probe_under_comm_s``): with more ranks than cores, gloo's threads
    take a larger share of each core, so one figure for every world size misstates both."""
    return {int(w): fit_comm_slowdown(g["probe_s"].tolist(), g["probe_under_comm_s"].tolist(),
                                      floor, cap)
            for w, g in contention.groupby("world")}


def fit_comm_slowdown(together_s: Sequence[float], under_comm_s: Sequence[float],
                      floor: float = 0.01, cap: float = 0.9) -> float:
    """The fluid model's ``s`` from a probe's time alone and with an exchange in flight all
    along: ``t_under = t / (1 - s)``, so ``s = 1 - t / t_under`` (median over the pairs,
    clamped to [floor, cap])."""
    t = np.asarray(together_s, dtype=float)
    u = np.asarray(under_comm_s, dtype=float)
    s = float(np.median(1.0 - t / u))
    return float(min(cap, max(floor, s)))
