"""The roofline, once: ``roof`` (numpy arrays in, seconds out) and what every family reads around it.

    time = max(flops / F, bytes / B)                       (``mode="max"``: a GPU overlaps them)
    time = flops_scale * flops / F + bytes_scale * bytes / B   (``mode="sum"``: one CPU core does
                                                              both in turn, each term its factor)

with achievable (not peak) figures from the profile's ``efficiency`` tables (``achievable_flops``,
``achievable_bandwidth``). Every compute op's roofline in this package (``roof_at``: the
profile's figures for a dtype and op class), the roofline at a table's other features (the
families' ``roofline_at``), the grouped GEMM over per-expert counts, and calibrate's fit
(``epsim.calibrate.fit``) call :func:`roof`; one op's scalar time is ``roof`` at that op, the same
float operations as at a row of many.

Also here, the per-op-class figures a calibrated profile adds around any cost model:
``calibrated`` (``time = overhead[kind] + scale[kind] * roofline``), ``final_scaled``
(``efficiency.op_final_scale`` on the final time, whatever timed it, applied once per op by
``sim.step.cost.timing``), ``op_class`` (their key); and ``KindCosting``, one family's entry per
op kind (``sim.step.cost.registry``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from epsim.model.dtypes import COMPUTE_DTYPE
from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import Efficiency, HardwareProfile

from .context import CostContext

#: ``(ops, ctx) -> [ops]`` seconds of a family's roofline at each op
TimesFn = Callable[[Sequence[Op], CostContext], np.ndarray]
#: ``(op, top_k) -> {feature: value}``, None where no table can describe the op
FeaturesFn = Callable[[Op, int | None], dict[str, float] | None]
#: ``(op, ctx, {feature: [rows]}) -> [rows]`` seconds
RooflineAtFn = Callable[[Op, CostContext, dict[str, np.ndarray]], np.ndarray]


def roof(flops, moved, flops_per_s, bytes_per_s, mode: str = "max", flops_scale=1.0,
         bytes_scale=1.0):
    """Seconds of ``flops`` at ``flops_per_s`` and ``moved`` bytes at ``bytes_per_s`` (arrays or
    scalars, broadcast): whichever binds (``mode="max"``), or both in turn, each times its
    factor (``"sum"``). Elementwise: a row's answer is the same alone or among many."""
    t_flops = np.divide(flops, flops_per_s)
    t_bytes = np.divide(moved, bytes_per_s)
    if mode == "sum":
        return flops_scale * t_flops + bytes_scale * t_bytes
    return np.maximum(t_flops, t_bytes)


def eff(profile: HardwareProfile) -> Efficiency:
    return profile.require_efficiency()


def achievable_flops(profile: HardwareProfile, dtype: str) -> float:
    """Achievable FLOP/s of a large GEMM in ``dtype``."""
    compute = "bf16" if dtype.startswith("fp8_") else dtype
    return profile.peak(compute) * eff(profile).gemm_fraction(compute)


def achievable_bandwidth(profile: HardwareProfile) -> float:
    """Achievable HBM bytes/s."""
    return profile.hbm_bandwidth * eff(profile).hbm_fraction


def roof_at(profile: HardwareProfile, flops, moved, dtype: str, kind: str | None = None):
    """:func:`roof` on the profile's achievable figures for ``dtype``; under ``efficiency.roofline
    == "sum"`` (a CPU core) the two terms add, each with ``kind``'s factor (``op_time_scale`` /
    ``op_bytes_scale``)."""
    e = eff(profile)
    f, b = achievable_flops(profile, dtype), achievable_bandwidth(profile)
    if e.roofline == "sum" and kind is not None:
        return roof(flops, moved, f, b, "sum", e.scale(kind), e.bytes_scale(kind))
    return roof(flops, moved, f, b)


def roof_rows(profile: HardwareProfile, flops, moved, dtypes: Sequence[str],
              kinds: Sequence[str]) -> np.ndarray:
    """:func:`roof_at` of many ops at once, row ``i`` on ``dtypes[i]``'s figures with
    ``kinds[i]``'s factors (a family's ``times``): row by row the same float operations as
    :func:`roof_at` of that row alone."""
    e = eff(profile)
    rate = {d: achievable_flops(profile, d) for d in set(dtypes)}
    f = np.array([rate[d] for d in dtypes], dtype=np.float64)
    b = achievable_bandwidth(profile)
    if e.roofline == "sum":
        return roof(flops, moved, f, b, "sum", np.array([e.scale(k) for k in kinds]),
                    np.array([e.bytes_scale(k) for k in kinds]))
    return roof(flops, moved, f, b)


def op_class(op: Op) -> str:
    """The key of an op's fitted per-kind figures: its kind, or ``gemm.batched`` for a batched
    GEMM (MLA's per-head absorption: another kernel family; falls back to ``gemm``)."""
    if op.kind == "gemm" and op.dims.get("batch", 1) > 1:
        return "gemm.batched"
    return op.kind


def streaming_dtype(op: Op, profile: HardwareProfile) -> str:
    """The op's dtype where the profile has a peak for it, else BF16."""
    return op.dtype if op.dtype in profile.peak_flops else "bf16"


def calibrated(kind: str, seconds: float | np.ndarray, profile: HardwareProfile
               ) -> float | np.ndarray:
    """A compute op's cost-model ``seconds`` with the profile's per-kind overhead and factor
    (identity for profiles without them)."""
    e = eff(profile)
    if e.roofline == "sum":  # the per-kind factors are inside the roofline's two terms
        return e.overhead(kind) + seconds
    return e.overhead(kind) + e.scale(kind) * seconds


def final_scaled(op: Op, profile: HardwareProfile, seconds):
    """``seconds`` (an op's final time, any shape) times the profile's fitted
    ``op_final_scale`` factor of the op's class; unchanged without one (no shipped profile has
    any)."""
    e = profile.efficiency
    if e is None or not e.op_final_scale:
        return seconds
    return seconds * e.final_scale(op_class(op))


def compute_dtype(op: Op) -> str:
    return COMPUTE_DTYPE.get(op.dtype, op.dtype)


# the figures each family's roofline reads: a GEMM-like compute roof, a streaming op's, an EP
# exchange's (NIC and all-to-all latency too), another collective's
COMPUTE_KEYS = ("peak_flops", "hbm_bandwidth", "efficiency.gemm_flops_fraction",
                "efficiency.hbm_fraction", "efficiency.gemm_tile_m")
STREAMING_KEYS = ("peak_flops", "hbm_bandwidth", "efficiency.hbm_fraction")


@dataclass(frozen=True)
class KindCosting:
    """How one op kind is costed (one entry of its family's ``COSTING``).

    family: the family module's name. Example: ``"gemm"``.
    times: ``(ops, ctx) -> [ops]`` seconds of the kind's roofline at each of ``ops`` (of the
        family's kinds, any mix; nominal routing for a grouped GEMM and the collectives), before
        ``calibrated``: the family's one formula, whose value at ``[op]`` is the op's scalar
        time (``seconds``).
    sources: the profile keys the kind's roofline reads. Example: ``("peak_flops",
        "hbm_bandwidth", "efficiency.hbm_fraction")``.
    features: ``(op, top_k) -> {feature: value}`` a table is looked up at (None for an op no
        table can describe: an unfused grouped GEMM); None: no table times the kind. Example
        (gemm): ``{"m": 512, "n": 7168, "k": 2048, "batch": 1}``. Its names are the kind's
        ``kernel_tables.FEATURES`` (the table format the profile parser reads).
    roofline_at: ``(op, ctx, f) -> [rows]`` seconds of the kind's roofline at ``f``
        (``{feature: [rows] values}``, every ``FEATURES[kind]`` name), the op's other constants
        taken from ``op`` (a collective's: whether its group spans nodes, ``ctx.captured``).
        Given with ``features``.
    table_dtype: ``op -> dtype`` a table must have to time the op. Example: ``"fp8"``.
    scoped: tables of the kind are chosen per scope (the collectives: ``COLLECTIVE_TABLES``).
    exchange: an EP exchange, whose uniform traffic follows the step's exchange mode
        (``sim.hardware.a2a``: node-then-GPU under a hierarchical one).
    collective: timed by its busiest link (``sim.step.cost.comm``), not a compute roofline,
        so no per-kind ``calibrated`` figures.
    """

    family: str
    times: TimesFn
    sources: tuple[str, ...]
    features: FeaturesFn | None = None
    roofline_at: RooflineAtFn | None = None
    table_dtype: Callable[[Op], str] = compute_dtype
    scoped: bool = False
    exchange: bool = False
    collective: bool = False

    def seconds(self, op: Op, ctx: CostContext) -> float:
        """One op's roofline seconds: ``times`` at ``[op]``."""
        return float(self.times([op], ctx)[0])


def per_kind(ops: Sequence[Op], ctx: CostContext,
             forms: dict[str, Callable[[list[Op], HardwareProfile], np.ndarray]]
             ) -> np.ndarray:
    """``[ops]`` seconds, a family's ops of any mix of its kinds, each kind's ops through its
    own vector form (``forms``: kind -> ``form(ops, profile) -> [ops]`` seconds)."""
    out = np.zeros(len(ops))
    for kind, form in forms.items():
        rows = [i for i, op in enumerate(ops) if op.kind == kind]
        if rows:
            out[rows] = form([ops[i] for i in rows], ctx.profile)
    return out
