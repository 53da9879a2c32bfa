"""Kernel tables: measured times of one op kind over its features, and their lookup.

A :class:`Table` holds the points of one ``kernels`` table of a hardware profile (parsed by
``epsim.sim.hardware.kernel_sets.parse_kernels``); ``FEATURES`` names each op kind's features, ``SELECTORS``
the defaulted ones that say which kernel a table measured.

Lookup (:func:`lookup`, :meth:`Table.locate`): a point's own features give its time exactly.
Otherwise the features are resolved in the order of ``FEATURES[kind]`` (the swept feature last):
a feature whose value some remaining point has restricts to those points; else the nearest value
below and above bracket it and both halves are resolved further. When every bracket exists the
time is interpolated linearly in log(time) over log(feature) (multilinear on a rectilinear grid),
so it lies between the bracketing points' times (never overshooting measured, possibly
non-monotone data). Otherwise (outside the table's range, or a missing corner) the nearest point
(Euclidean distance over log features) is scaled by ``roofline(query) / roofline(point)`` and the
result is marked extrapolated.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from epsim.model.errors import EpsimError

#: per op kind: (feature, default or None) in resolution order, the swept feature last
FEATURES: dict[str, tuple[tuple[str, float | None], ...]] = {
    "gemm": (("batch", 1.0), ("n", None), ("k", None), ("m", None)),
    "grouped_gemm": (("hidden", None), ("inter", None), ("experts", None), ("top_k", None),
                     ("tokens", None)),
    "attention_decode": (("qk_dim", 576.0), ("v_dim", 512.0), ("heads", None),
                         ("query_tokens", 1.0), ("batch", None), ("context", None)),
    # prefill attention: every table lists the head widths (a table measured at other widths
    # than the op's times it by its nearest point scaled by the roofline ratio: a transfer,
    # marked extrapolated); ``tokens`` = new tokens per sequence, ``context`` = the cached
    # prefix plus them (a fresh prefill: context = tokens)
    "attention_prefill": (("qk_dim", None), ("v_dim", None), ("heads", None), ("context", None),
                          ("batch", None), ("tokens", None)),
    "dispatch": (("hidden", None), ("ranks", None), ("tokens", None)),
    "combine": (("hidden", None), ("ranks", None), ("tokens", None)),
    "all_reduce": (("ranks", None), ("bytes", None)),
    "all_gather": (("ranks", None), ("bytes", None)),
}
#: defaulted features that select the kernel: a table without one describes only ops at its
#: default (a GEMM table without ``batch``: plain GEMMs, not MLA's batched absorption; a decode
#: table without ``qk_dim`` / ``v_dim``: MLA decode over DeepSeek's 576-wide latent); other
#: defaulted features (``query_tokens``) are constant columns, so other values extrapolate
SELECTORS: dict[str, frozenset[str]] = {"gemm": frozenset({"batch"}),
                                        "attention_decode": frozenset({"qk_dim", "v_dim"})}
COLLECTIVE_TABLES = frozenset({"dispatch", "combine", "all_reduce", "all_gather"})
SCOPES = ("intra", "inter")
#: the EP exchange modes a table may name (``sim.hardware.a2a.A2A_MODES``), and the kinds whose
#: tables may: the exchanges, and the fused MoE, whose kernel follows the exchange's layout
#: (DeepEP low-latency hands DeepGEMM's masked grouped GEMM its tokens, the normal exchange the
#: contiguous one)
TABLE_MODES = ("low_latency", "normal")
MODE_KINDS = frozenset({"dispatch", "combine", "grouped_gemm"})
#: how the plan lays the MoE experts out, which a fused-MoE table may name: ``ep`` (each rank
#: holds whole experts of its own, tokens exchanged) or ``tp`` (TP-only: every rank holds a
#: 1 / tp slice of every expert's inter dim and sees every token)
LAYOUTS: dict[str, str] = {
    "ep": "expert parallel: each rank runs its own whole experts on the tokens routed to them",
    "tp": "TP-only MoE: every rank runs a 1/tp slice of every expert on all of its tokens",
}
LAYOUT_KINDS = frozenset({"grouped_gemm"})
#: power of ten from a unit to seconds; 671.55 us becomes the double nearest 671.55e-6 (decimal
#: arithmetic on the published digits, not a float product)
UNITS = {"s": 0, "ms": -3, "us": -6}
METHODS = ("table-exact", "table-interpolated", "table-extrapolated", "roofline", "scaled-set")
EXACT, INTERPOLATED, EXTRAPOLATED = 0, 1, 2

_LEAF_CACHE = 4096  # resolved fixed-feature tuples kept per table
_TINY = float(np.finfo(np.float64).tiny)  # the smallest value a distance's log is taken of
_MISSING = object()  # a memo's miss (None is a kept answer: no brackets)


@dataclass(frozen=True, eq=False)
class Table:
    """Measured times of one op kind in one dtype (and scope).

    op / dtype / scope / quant: what was measured. Example: ``"grouped_gemm"``, ``"fp8"``,
        ``"intra"``, ``"per_1x128"``.
    features: the kind's feature names in resolution order (``FEATURES[op]``).
    x: ``[points, features]`` feature values; seconds: ``[points]``; sources: per point, an id.
    unit / published: the times as the source gives them. Example: ``"us"``, ``[671.55, ...]``.
    listed: the features the table lists (the others sit at their defaults).
    where: the table's place in the profile, for messages. Example ``"kernels.sets.aiter.tables[0]"``.
    mode: the EP exchange mode the measured kernels ran in (``sim.hardware.a2a``:
        ``"low_latency"`` / ``"normal"``; ``MODE_KINDS`` only: an exchange, or the fused MoE
        behind it); ``""``: any mode.
    layout: the MoE layout it measured (``LAYOUTS``: ``"ep"`` / ``"tp"``; ``LAYOUT_KINDS``
        only); ``""``: any.
    note: what the table measured, as the profile says (``--explain`` prints it).
    """

    op: str
    dtype: str
    scope: str
    quant: str
    features: tuple[str, ...]
    x: np.ndarray
    seconds: np.ndarray
    sources: tuple[str, ...]
    where: str
    unit: str = "s"
    published: tuple[float, ...] = ()
    listed: tuple[str, ...] = ()
    mode: str = ""
    layout: str = ""
    note: str = ""
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._cache["log_x"] = np.log(self.x)
        self._cache["log_t"] = np.log(self.seconds)
        self._cache["exact"] = {tuple(row): i for i, row in enumerate(self.x.tolist())}

    @property
    def deployment(self) -> str:
        """The selectors the table names, for messages. Example: ``"ep, low_latency"``; ``""``:
        none (it times every deployment of its kind)."""
        return ", ".join(filter(None, (self.layout, self.mode)))

    def matches(self, mode: str, layout: str) -> bool:
        """Whether a step in exchange ``mode`` with MoE ``layout`` may use the table (a selector
        the step does not give, ``""``, excludes nothing)."""
        return (not mode or not self.mode or self.mode == mode) and \
            (not layout or not self.layout or self.layout == layout)

    def __len__(self) -> int:
        return len(self.seconds)

    def point(self, i: int) -> dict[str, Any]:
        """Point ``i`` as JSON: its features, its time as published (and unit), its source id."""
        feats = {n: int(v) if float(v).is_integer() else v
                 for n, v in zip(self.features, self.x[i].tolist(), strict=True)}
        time = self.published[i] if self.published else float(self.seconds[i])
        return {"features": feats, "time": time, "unit": self.unit if self.published else "s",
                "source": self.sources[i]}

    def describes(self, features: Mapping[str, float]) -> bool:
        """Whether the table is about an op with these features (``SELECTORS``)."""
        return all(name in self.listed or float(features.get(name, default)) == default
                   for name, default in FEATURES[self.op]
                   if name in SELECTORS.get(self.op, ()))

    def vector(self, features: Mapping[str, float]) -> tuple[float, ...]:
        """A feature mapping (defaulted features may be omitted) in resolution order."""
        out = []
        for name, default in FEATURES[self.op]:
            if name in features:
                out.append(float(features[name]))
            elif default is not None:
                out.append(default)
            else:
                raise EpsimError(f"{self.where}: a {self.op} lookup needs feature {name!r}")
        return tuple(out)

    # -- interpolation --------------------------------------------------------------------

    def _memo(self, name: str, fixed: tuple[float, ...], make: Callable[[], Any]) -> Any:
        """``make()`` kept in the table's cache ``name`` by fixed-feature tuple (at most
        ``_LEAF_CACHE`` of them; the cache starts over when full)."""
        memo = self._cache.setdefault(name, {})
        hit = memo.get(fixed, _MISSING)
        if hit is _MISSING:
            if len(memo) >= _LEAF_CACHE:
                memo.clear()
            hit = memo[fixed] = make()
        return hit

    def _leaves(self, fixed: tuple[float, ...]) -> list[tuple[float, np.ndarray]] | None:
        """The 1-D point sets (sorted along the swept feature) whose log-linear blend, with
        these weights, gives the table at ``fixed`` (every feature but the last); None: some
        bracket is missing."""
        return self._memo("leaves", fixed,
                          lambda: self._resolve(np.arange(len(self)), 0, fixed))

    def _resolve(self, subset: np.ndarray, d: int, fixed: tuple[float, ...]
                 ) -> list[tuple[float, np.ndarray]] | None:
        if d == len(self.features) - 1:
            return [(1.0, subset[np.argsort(self.x[subset, d], kind="stable")])]
        col, q = self.x[subset, d], fixed[d]
        same = col == q
        if same.any():
            return self._resolve(subset[same], d + 1, fixed)
        below, above = col[col < q], col[col > q]
        if q <= 0 or not below.size or not above.size:
            return None
        lo, hi = below.max(), above.min()
        w = (math.log(q) - math.log(lo)) / (math.log(hi) - math.log(lo))
        a = self._resolve(subset[col == lo], d + 1, fixed)
        b = self._resolve(subset[col == hi], d + 1, fixed)
        if a is None or b is None:
            return None
        return [(wt * (1.0 - w), leaf) for wt, leaf in a] + [(wt * w, leaf) for wt, leaf in b]

    def locate(self, fixed: Sequence[float], values: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The table at ``fixed`` (every feature but the swept one) and each swept ``value``.

        Returns ``(method, seconds, nearest)``, each ``[len(values)]``: ``EXACT`` / ``INTERPOLATED``
        with the table's time, or ``EXTRAPOLATED`` with the nearest point's (unscaled) time and
        its index in ``nearest`` (-1 elsewhere)."""
        fixed = tuple(float(v) for v in fixed)
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        if len(v) == 1:  # one op's own features: scalar arithmetic, no array calls
            how, secs, near = self.locate_one(fixed, float(v[0]))
            return np.array([how]), np.array([secs]), np.array([near])
        m = len(v)
        method = np.full(m, EXTRAPOLATED)
        secs = np.zeros(m)
        leaves = self._leaf_arrays(fixed)
        inside = v > 0
        if leaves is not None:
            for _, xs, _, _, _ in leaves:
                inside &= (v >= xs[0]) & (v <= xs[-1])
        else:
            inside[:] = False
        if inside.any():
            vi = v[inside]
            lv = np.log(vi)
            acc = np.zeros(len(vi))
            t_min = np.full(len(vi), np.inf)
            t_max = np.zeros(len(vi))
            for w, xs, log_xs, log_ts, ts in leaves:
                acc += w * np.interp(lv, log_xs, log_ts)
                hi = np.minimum(np.searchsorted(xs, vi), len(xs) - 1)
                lo = np.where(xs[hi] == vi, hi, np.maximum(hi - 1, 0))
                t_lo, t_hi = ts[lo], ts[hi]
                t_min = np.minimum(t_min, np.minimum(t_lo, t_hi))
                t_max = np.maximum(t_max, np.maximum(t_lo, t_hi))
            # exp(log(t)) may be off by an ulp: keep the result between its bracketing points
            t = np.clip(np.exp(acc), t_min, t_max)
            how = np.full(len(vi), INTERPOLATED)
            if len(leaves) == 1:  # every fixed feature exact: a knot is a measured point
                knot = xs[hi] == vi  # hi: the first knot at or above each value
                t = np.where(knot, t_hi, t)
                how = np.where(knot, EXACT, how)
            secs[inside] = t
            method[inside] = how
        out = ~inside
        nearest = np.full(m, -1)
        if out.any():
            log_x = self._cache["log_x"]
            base = self._nearest_base(fixed)
            lv = np.log(np.maximum(v[out], np.finfo(np.float64).tiny))
            dist = base[None, :] + (log_x[None, :, -1] - lv[:, None]) ** 2
            near = np.argmin(dist, axis=1)
            nearest[out] = near
            secs[out] = self.seconds[near]
        return method, secs, nearest

    def _leaf_arrays(self, fixed: tuple[float, ...]) -> list[tuple] | None:
        """``_leaves(fixed)`` with each leaf's arrays read out once: ``(weight, xs, log xs,
        log times, times)`` along the swept feature."""
        def make() -> list[tuple] | None:
            leaves = self._leaves(fixed)
            return None if leaves is None else [
                (w, self.x[leaf, -1], self._cache["log_x"][leaf, -1],
                 self._cache["log_t"][leaf], self.seconds[leaf])
                for w, leaf in leaves]
        return self._memo("leaf_arrays", fixed, make)

    def _leaf_lists(self, fixed: tuple[float, ...]) -> list[tuple] | None:
        """:meth:`_leaf_arrays` as Python lists (one value's lookup reads them without array
        calls)."""
        def make() -> list[tuple] | None:
            leaves = self._leaf_arrays(fixed)
            return None if leaves is None else [
                (w, *(a.tolist() for a in arrays)) for w, *arrays in leaves]
        return self._memo("leaf_lists", fixed, make)

    def _nearest_base(self, fixed: tuple[float, ...]) -> np.ndarray:
        """``[points]`` squared log distance of every point's fixed features to ``fixed``."""
        log_x = self._cache["log_x"]
        tiny = np.log(np.finfo(np.float64).tiny)
        return self._memo("nearest_base", fixed, lambda: sum(
            (log_x[:, d] - (math.log(q) if q > 0 else tiny)) ** 2 for d, q in enumerate(fixed)))

    def locate_one(self, fixed: tuple[float, ...], value: float) -> tuple[int, float, int]:
        """:meth:`locate` of one value, ``(method, seconds, nearest)``: the same arithmetic as
        the array path (numpy's ``log`` / ``exp``, ``np.interp``'s formula), so equal results."""
        leaves = self._leaf_lists(fixed)
        inside = value > 0 and leaves is not None and all(
            xs[0] <= value <= xs[-1] for _, xs, _, _, _ in leaves)
        if not inside:
            lv = float(np.log(max(value, _TINY)))
            dist = self._nearest_base(fixed) + (self._cache["log_x"][:, -1] - lv) ** 2
            near = int(np.argmin(dist))
            return EXTRAPOLATED, float(self.seconds[near]), near
        lv = float(np.log(value))
        acc, t_min, t_max = 0.0, math.inf, 0.0
        for w, xs, lxs, lts, ts in leaves:
            acc += w * _interp_one(lv, lxs, lts)
            hi = min(bisect.bisect_left(xs, value), len(xs) - 1)
            lo = hi if xs[hi] == value else max(hi - 1, 0)
            t_min = min(t_min, min(ts[lo], ts[hi]))
            t_max = max(t_max, max(ts[lo], ts[hi]))
        # exp(log(t)) may be off by an ulp: keep the result between its bracketing points
        t = min(max(float(np.exp(acc)), t_min), t_max)
        if len(leaves) == 1:  # every fixed feature exact: a knot is a measured point
            _, xs, _, _, ts = leaves[0]
            j = min(bisect.bisect_left(xs, value), len(xs) - 1)
            if xs[j] == value:
                return EXACT, ts[j], -1
        return INTERPOLATED, t, -1

    def points_used(self, features: Sequence[float]) -> tuple[int, ...]:
        """Indices of the points a lookup at ``features`` (resolution order) rests on."""
        fixed, value = tuple(features[:-1]), float(features[-1])
        method, _, nearest = self.locate(fixed, np.array([value]))
        if method[0] == EXTRAPOLATED:
            return (int(nearest[0]),)
        used: set[int] = set()
        for _, leaf in self._leaves(fixed):
            xs = self.x[leaf, -1]
            hi = min(int(np.searchsorted(xs, value)), len(xs) - 1)
            lo = hi if xs[hi] == value else max(hi - 1, 0)
            used.update((int(leaf[lo]), int(leaf[hi])))
        return tuple(sorted(used))


def _interp_one(x: float, xp: list[float], fp: list[float]) -> float:
    """``np.interp(x, xp, fp)`` of one value, by numpy's own formula and cases."""
    n = len(xp)
    if n == 1:
        return fp[0]
    j = bisect.bisect_right(xp, x) - 1  # the last knot at or below x
    if j < 0:
        return fp[0]
    if j >= n - 1:  # at or past the last knot
        return fp[n - 1]
    if xp[j] == x:
        return fp[j]
    slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j])
    out = slope * (x - xp[j]) + fp[j]
    if math.isnan(out):
        out = slope * (x - xp[j + 1]) + fp[j + 1]
        if math.isnan(out) and fp[j] == fp[j + 1]:
            out = fp[j]
    return out


@dataclass(frozen=True)
class How:
    """How a lookup was answered: ``method`` (one of ``METHODS``), the points used (indices
    into the table) and their source ids, and for an extrapolation the roofline ratio applied
    to the nearest point."""

    method: str
    points: tuple[int, ...]
    sources: tuple[str, ...] = ()
    ratio: float = 1.0


def lookup(table: Table, features: Mapping[str, float],
           roofline: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[float, How]:
    """Seconds at ``features`` (``{name: value}``) and how they were found.

    ``roofline(x)``: seconds of the kind's roofline at each row of ``x`` (``[rows, features]``
    in resolution order), used to scale the nearest point outside the table; None: unscaled."""
    vec = table.vector(features)
    method, secs, nearest = table.locate(vec[:-1], np.array([vec[-1]]))
    if method[0] != EXTRAPOLATED:
        used = table.points_used(vec)
        return float(secs[0]), How(METHODS[int(method[0])], used,
                                   tuple(table.sources[i] for i in used))
    i = int(nearest[0])
    ratio = 1.0
    if roofline is not None:
        r = roofline(np.array([vec, table.x[i]]))
        ratio = float(r[0] / r[1]) if r[1] > 0 else 1.0
    return float(secs[0] * ratio), How("table-extrapolated", (i,), (table.sources[i],), ratio)
