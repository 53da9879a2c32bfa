"""The ``efficiency`` section of a hardware profile: achievable fractions of the peaks, fixed costs
and the figures ``epsim calibrate`` fits (every key is documented in ``epsim.sim.hardware.profile``'s
module docstring, with the rest of the profile schema).

    EFFICIENCY_KEYS            the required keys; OPTIONAL_EFFICIENCY_KEYS the others
    SCALE_GROUPS / SCALE_KEYS  what an ``op_final_scale`` key may name
    Efficiency                 the parsed section, with its lookups (latency and slowdown tables
                               per group size, per-kind overheads and scales)
    parse_efficiency           the section checked and parsed (one-line errors)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from epsim.model.bounds import (
    MAX_PROFILE_NUMBER,
    MIN_PROFILE_NUMBER,
    check_count,
    show,
)
from epsim.model.errors import EpsimError
from epsim.model.opgraph import OP_KINDS

EFFICIENCY_KEYS: tuple[str, ...] = (
    "gemm_flops_fraction", "gemm_tile_m", "hbm_fraction", "attention_split_tokens",
    "link_bandwidth_usable", "nic_bandwidth_usable", "a2a_latency_s", "collective_latency_s",
    "collective_latency_graph_s", "graph_launch_s", "graph_node_s", "comm_compute_slowdown",
)
_FRACTION_KEYS = ("hbm_fraction", "comm_compute_slowdown")
OPTIONAL_EFFICIENCY_KEYS: tuple[str, ...] = (
    "op_overhead_s", "op_time_scale", "op_bytes_scale", "roofline", "a2a_latency_per_peer_s", "combine_latency_s",
    "combine_latency_per_peer_s", "a2a_latency_by_group_s", "rank_compute_slowdown",
    "rank_compute_slowdown_by_kind", "comm_concurrency", "op_final_scale", "host_ms_per_step",
    "a2a_host_block_by_group_s", "exchange_straggler_fraction", "comm_compute_slowdown_by_group",
    "rank_skew_by_group_s", "a2a_host_block_fraction", "kernel_floor_s", "framework_dispatch_s",
)
#: the groups of op kinds an ``op_final_scale`` key may name (besides a kind or an op class)
SCALE_GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("attention_decode", "attention_prefill"),
    "communication": ("dispatch", "combine", "all_reduce", "all_gather"),
    "other": ("norm", "rope", "router", "elementwise", "embedding", "lm_head", "sample"),
}
#: the keys ``op_final_scale`` accepts
SCALE_KEYS: tuple[str, ...] = (*SCALE_GROUPS, *OP_KINDS, "gemm.batched")
_GROUP_OF = {kind: group for group, kinds in SCALE_GROUPS.items() for kind in kinds}


@dataclass(frozen=True)
class Efficiency:
    """Achievable-efficiency figures the cost model reads (see the module docstring).

    gemm_flops_fraction: ``{dtype: fraction}``. Example (MI300X hipBLASLt): ``{"bf16": 0.5415,
        "fp8": 0.4868}`` (708 / 1307.4 and 1273 / 2614.9).
    gemm_tile_m: 16 (CDNA3 MFMA 16x16 tiles).
    hbm_fraction: 0.7925 (4.2 of 5.3 TB/s).
    attention_split_tokens: 512.
    link_bandwidth_usable: 48e9 (xGMI per link).
    nic_bandwidth_usable: 45e9.
    a2a_latency_s: 21.8e-6 (MORI-EP, derived in docs/hardware.md).
    collective_latency_s / collective_latency_graph_s: 13e-6 / 6.8e-6.
    graph_launch_s / graph_node_s: 4.5e-6 / 1e-6.
    comm_compute_slowdown: 0.21 (64 of 304 CUs).
    attention_decode_flops: ``{kv dtype: FLOP/s}``, empty when no kernel figure is published.
        Example (MI300X, aiter FP8 MLA decode): ``{"fp8": 3.67e14}``.
    op_overhead_s: ``{kind: seconds}``, empty on GPUs. Example (a CPU): ``{"norm": 2.1e-5}``.
    op_time_scale: ``{kind: factor}``, empty on GPUs. Example: ``{"attention_decode": 3.2}``.
    op_bytes_scale: ``{kind: factor}`` (``roofline == "sum"`` only; missing kinds: 1).
    roofline: ``"max"`` (GPUs) or ``"sum"`` (a fitted CPU profile).
    a2a_latency_per_peer_s: 0 unless fitted. Example (gloo on a CPU): 1.5e-4.
    combine_latency_s: ``None``: a combine costs ``a2a_latency_s`` like a dispatch.
    combine_latency_per_peer_s: ``None``: as ``a2a_latency_per_peer_s``.
    a2a_latency_by_group_s: ``{kind: {group size: seconds}}``, empty unless fitted. Example
        (gloo, 2 cores): ``{"dispatch": {2: 3.1e-3, 4: 9.0e-3}}``.
    rank_compute_slowdown: ``{ranks: factor}``, empty: every rank has its own device. Example
        (4 local ranks on a 2-core CPU): ``{2: 1.4, 4: 2.1}``.
    rank_compute_slowdown_by_kind: ``{op class: {ranks: factor}}``, empty unless fitted.
        Example: ``{"norm": {2: 1.3, 4: 1.5}, "attention_decode": {2: 1.15, 4: 1.9}}``.
    comm_concurrency: collectives in flight at once per rank. Example: 1 (GPU), 2 (gloo).
    a2a_host_block_by_group_s: ``{kind: {group size: seconds}}``, empty unless fitted. Example
        (gloo, 2 cores): ``{"dispatch": {2: 3.6e-3, 4: 9.8e-3}, "combine": {2: 5e-4, 4: 4e-3}}``.
    exchange_straggler_fraction: ``{ranks per node: fraction}`` (looked up at
        ``min(world size, gpus_per_node)``), empty unless fitted (``epsim calibrate
        --exchange-fit last-plus-straggler``). Example (2 cores): ``{2: 0.05, 4: 0.4}``.
    op_final_scale: ``{class, kind or group: factor}`` on the final op time, empty unless fitted.
        Example: ``{"attention": 1.3, "grouped_gemm": 0.8}``.
    host_ms_per_step: the engine's host time per step fitted to one stack, ``None`` unless
        fitted. Example: 6.0.
    a2a_host_block_fraction: ``{ranks per node: fraction}``: a dispatch holds an eager host
        this share of the compute issued since the previous exchange longer than its
        ``a2a_host_block_by_group_s`` entry (its blocking count exchange waits for ranks that
        drifted apart over that compute); empty unless fitted (``epsim calibrate``'s in-step
        fit). Example (2 cores): ``{2: 0.05, 4: 0.3}``.
    rank_skew_by_group_s: ``{ranks per node: seconds}`` (looked up at ``min(world size,
        gpus_per_node)``) the slowest rank's step beyond the mean rank's when ranks share a
        node's cores: a step lasts as long as its slowest rank, the simulator's ranks run alike;
        empty unless fitted (``epsim calibrate``'s ranks sweep). Example (2 cores):
        ``{2: 1.0e-3, 4: 6.0e-3}``.
    kernel_floor_s: the least time one kernel occupies the device inside a captured graph
        (launch to finish of a tiny kernel, the gap to the next included); each kernel of an
        op's inventory (``sim.hardware.kernel_inventory``) costs at least this; 0: no floor.
        Example (MI300X, aiter's smallest tuned GEMM point): 3.2169e-6.
    framework_dispatch_s: host seconds the framework spends per kernel outside a graph beyond
        the driver's ``kernel_launch_s`` (PyTorch eager dispatch of the op that launches it);
        0 unless sourced. Example: 4.5e-6.
    """

    gemm_flops_fraction: Mapping[str, float]
    gemm_tile_m: int
    hbm_fraction: float
    attention_split_tokens: int
    link_bandwidth_usable: float
    nic_bandwidth_usable: float
    a2a_latency_s: float
    collective_latency_s: float
    collective_latency_graph_s: float
    graph_launch_s: float
    graph_node_s: float
    comm_compute_slowdown: float
    attention_decode_flops: Mapping[str, float] = field(default_factory=dict)
    op_overhead_s: Mapping[str, float] = field(default_factory=dict)
    op_time_scale: Mapping[str, float] = field(default_factory=dict)
    op_bytes_scale: Mapping[str, float] = field(default_factory=dict)
    roofline: str = "max"
    a2a_latency_per_peer_s: float = 0.0
    combine_latency_s: float | None = None
    combine_latency_per_peer_s: float | None = None
    a2a_latency_by_group_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    rank_compute_slowdown: Mapping[int, float] = field(default_factory=dict)
    rank_compute_slowdown_by_kind: Mapping[str, Mapping[int, float]] = field(
        default_factory=dict)
    comm_concurrency: int = 1
    op_final_scale: Mapping[str, float] = field(default_factory=dict)
    host_ms_per_step: float | None = None
    a2a_host_block_by_group_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    exchange_straggler_fraction: Mapping[int, float] = field(default_factory=dict)
    comm_compute_slowdown_by_group: Mapping[int, float] = field(default_factory=dict)
    rank_skew_by_group_s: Mapping[int, float] = field(default_factory=dict)
    kernel_floor_s: float = 0.0
    framework_dispatch_s: float = 0.0
    a2a_host_block_fraction: Mapping[int, float] = field(default_factory=dict)

    def a2a_latency(self, kind: str, group_size: int) -> float:
        """Fixed cost of one dispatch or combine in a group of ``group_size``."""
        table = self.a2a_latency_by_group_s.get(kind)
        if table:
            return _interpolate(table, group_size)
        base, per_peer = self.a2a_latency_s, self.a2a_latency_per_peer_s
        if kind == "combine":
            if self.combine_latency_s is not None:
                base = self.combine_latency_s
            if self.combine_latency_per_peer_s is not None:
                per_peer = self.combine_latency_per_peer_s
        return base + per_peer * max(0, group_size - 1)

    def host_block(self, kind: str, group_size: int) -> float | None:
        """Seconds an eager host is held issuing a ``kind`` exchange in a group of
        ``group_size`` (``a2a_host_block_by_group_s``, interpolated as ``a2a_latency``); None
        where not measured: a dispatch then holds the host for its latency, a combine not at
        all."""
        table = self.a2a_host_block_by_group_s.get(kind)
        return _interpolate(table, group_size) if table else None

    def host_block_fraction(self, ranks_per_node: int) -> float:
        """The share of the compute since the previous exchange a dispatch's count exchange
        holds the host beyond its fixed part (``a2a_host_block_fraction``; 0 at one rank,
        linear in between; 0 unless fitted)."""
        return _zero_at_one_rank(self.a2a_host_block_fraction, ranks_per_node)

    def straggler_fraction(self, group_size: int) -> float:
        """The last rank's lateness at an exchange per second of compute since the previous
        one (``exchange_straggler_fraction``; 0 at one rank, linear in between; 0 unless
        fitted)."""
        return _zero_at_one_rank(self.exchange_straggler_fraction, group_size)

    @staticmethod
    def _lookup(table: Mapping[str, float], kind: str, default: float) -> float:
        # an op class ("gemm.batched") falls back to its kind ("gemm")
        if kind in table:
            return table[kind]
        return table.get(kind.split(".")[0], default)

    def overhead(self, kind: str) -> float:
        """Fixed seconds added to each compute op of ``kind`` (0 unless fitted)."""
        return self._lookup(self.op_overhead_s, kind, 0.0)

    def scale(self, kind: str) -> float:
        """Factor on the roofline time of ``kind`` (1 unless fitted)."""
        return self._lookup(self.op_time_scale, kind, 1.0)

    def bytes_scale(self, kind: str) -> float:
        """Factor on the bytes term of ``kind`` under ``roofline == "sum"`` (1 unless fitted)."""
        return self._lookup(self.op_bytes_scale, kind, 1.0)

    def final_scale(self, op_class: str) -> float:
        """Factor on the final time of an op of ``op_class`` (``gemm.batched`` -> ``gemm`` ->
        its group; 1 unless fitted)."""
        table = self.op_final_scale
        if not table:
            return 1.0
        kind = op_class.split(".")[0]
        for key in (op_class, kind, _GROUP_OF.get(kind)):
            if key in table:
                return table[key]
        return 1.0

    def comm_slowdown(self, ranks_per_node: int) -> float:
        """Share of compute speed lost while an exchange is in flight, with ``ranks_per_node``
        ranks sharing a node (``comm_compute_slowdown_by_group``: linear between its measured
        points, the nearest end outside them; ``comm_compute_slowdown`` without the table)."""
        table = self.comm_compute_slowdown_by_group
        if not table:
            return self.comm_compute_slowdown
        points = sorted(table.items())
        return float(np.interp(ranks_per_node, [float(r) for r, _ in points],
                               [v for _, v in points]))

    def rank_skew(self, ranks_per_node: int) -> float:
        """Seconds the slowest of ``ranks_per_node`` ranks sharing a node's cores takes beyond
        the mean rank per step (``rank_skew_by_group_s``: 0 at one rank, linear between its
        measured points and the last two points' slope beyond, never falling; 0 without the
        table)."""
        return _zero_at_one_rank(self.rank_skew_by_group_s, ranks_per_node)

    def core_share(self, ranks_per_node: int, kind: str | None = None) -> float:
        """How much longer a compute op (of op class ``kind``) takes when ``ranks_per_node``
        ranks share a node's cores (``rank_compute_slowdown[_by_kind]``; 1 without them)."""
        table = self.rank_compute_slowdown
        if kind is not None and self.rank_compute_slowdown_by_kind:
            by_kind = self.rank_compute_slowdown_by_kind
            table = by_kind.get(kind) or by_kind.get(kind.split(".")[0]) or table
        if not table:
            return 1.0
        points = sorted({1: 1.0, **table}.items())
        xs = [float(r) for r, _ in points]
        ys = [f for _, f in points]
        if ranks_per_node >= xs[-1]:
            return ys[-1] * ranks_per_node / xs[-1]
        return float(np.interp(ranks_per_node, xs, ys))

    def gemm_fraction(self, dtype: str) -> float:
        """Achievable fraction for a compute dtype (fp16/fp32 fall back to bf16)."""
        if dtype in self.gemm_flops_fraction:
            return self.gemm_flops_fraction[dtype]
        return self.gemm_flops_fraction["bf16"]


def _interpolate(table: Mapping[int, float], group_size: int) -> float:
    """A measured ``{group size: seconds}`` table at ``group_size``: linear in between, the
    last two points' slope beyond (never falling), the first point below."""
    points = sorted(table.items())
    xs = [float(g) for g, _ in points]
    ys = [v for _, v in points]
    if group_size > xs[-1] and len(xs) > 1:
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (group_size - xs[-1])
    return float(np.interp(group_size, xs, ys))


def _zero_at_one_rank(table: Mapping[int, float], ranks: int) -> float:
    """A fitted ``{ranks: value}`` table that is 0 at one rank, at ``ranks`` (``_interpolate``
    from 0 at 1; never below 0; 0 without the table)."""
    if not table or ranks < 2:
        return 0.0
    return max(0.0, _interpolate({1: 0.0, **table}, ranks))


def _non_negative(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise EpsimError(f"{where} must be a non-negative number, got {value!r}")
    return float(value)


def _int_keyed(table: Any, where: str, zero: bool = False) -> dict[int, float]:
    """``{"2": 1.5, ...}`` -> ``{2: 1.5}``: positive integer keys, positive values (``zero``:
    non-negative)."""
    if not isinstance(table, Mapping) or not table:
        raise EpsimError(f"{where} must be a non-empty object {{positive integer: number}}")
    parsed = {}
    for k in table:
        try:
            key = int(k)
        except (TypeError, ValueError):
            key = 0
        if key < 1:
            raise EpsimError(f"{where}: keys must be positive integers, got {k!r}")
        parsed[key] = _non_negative(table[k], f"{where}.{k}") if zero else number(table, k, where)
    return parsed


def _optional_efficiency(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The optional efficiency keys present in ``obj``, checked."""
    out: dict[str, Any] = {}
    if "comm_concurrency" in obj:
        value = obj["comm_concurrency"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EpsimError(f"{where}: efficiency.comm_concurrency must be a positive integer, "
                             f"got {value!r}")
        out["comm_concurrency"] = value
    if "roofline" in obj:
        if obj["roofline"] not in ("max", "sum"):
            raise EpsimError(f"{where}: efficiency.roofline must be max or sum, got "
                             f"{obj['roofline']!r}")
        out["roofline"] = obj["roofline"]
    for key in ("op_overhead_s", "op_time_scale", "op_bytes_scale", "op_final_scale"):
        if key not in obj:
            continue
        table = obj[key]
        if not isinstance(table, Mapping):
            raise EpsimError(f"{where}: efficiency.{key} must be an object {{op kind: number}}")
        out[key] = {str(k): _non_negative(v, f"{where}: efficiency.{key}.{k}")
                    for k, v in table.items()}
    unknown = set(out.get("op_final_scale", {})) - set(SCALE_KEYS)
    if unknown:
        raise EpsimError(f"{where}: efficiency.op_final_scale names no op kind, class or group: "
                         f"{', '.join(sorted(unknown))} (one of {', '.join(SCALE_KEYS)})")
    for key in ("a2a_latency_per_peer_s", "combine_latency_per_peer_s", "host_ms_per_step",
                "kernel_floor_s", "framework_dispatch_s"):
        if key in obj:
            out[key] = _non_negative(obj[key], f"{where}: efficiency.{key}")
    if "combine_latency_s" in obj:
        out["combine_latency_s"] = number(obj, "combine_latency_s", f"{where}: efficiency")
    for key in ("a2a_latency_by_group_s", "a2a_host_block_by_group_s"):
        if key not in obj:
            continue
        table = obj[key]
        if not isinstance(table, Mapping) or not set(table) <= {"dispatch", "combine"}:
            raise EpsimError(f"{where}: efficiency.{key} must be an object "
                             "{dispatch|combine: {group size: seconds}}")
        # a hold may be nothing but its share of the compute (a2a_host_block_fraction): 0 is a
        # measured hold; a latency is never 0
        out[key] = {kind: _int_keyed(sub, f"{where}: efficiency.{key}.{kind}",
                                     zero=key == "a2a_host_block_by_group_s")
                    for kind, sub in table.items()}
    if "rank_compute_slowdown_by_kind" in obj:
        table = obj["rank_compute_slowdown_by_kind"]
        if not isinstance(table, Mapping):
            raise EpsimError(f"{where}: efficiency.rank_compute_slowdown_by_kind must be an "
                             "object {op class: {ranks: factor}}")
        out["rank_compute_slowdown_by_kind"] = {
            str(kind): _int_keyed(sub, f"{where}: efficiency.rank_compute_slowdown_by_kind.{kind}")
            for kind, sub in table.items()}
    if "exchange_straggler_fraction" in obj:
        out["exchange_straggler_fraction"] = _int_keyed(
            obj["exchange_straggler_fraction"], f"{where}: efficiency.exchange_straggler_fraction",
            zero=True)
    if "comm_compute_slowdown_by_group" in obj:
        where_table = f"{where}: efficiency.comm_compute_slowdown_by_group"
        table = out["comm_compute_slowdown_by_group"] = _int_keyed(
            obj["comm_compute_slowdown_by_group"], where_table, zero=True)
        if any(v >= 1 for v in table.values()):
            raise EpsimError(f"{where_table}: each share must be below 1")
    if "a2a_host_block_fraction" in obj:
        out["a2a_host_block_fraction"] = _int_keyed(
            obj["a2a_host_block_fraction"], f"{where}: efficiency.a2a_host_block_fraction",
            zero=True)
    if "rank_skew_by_group_s" in obj:
        out["rank_skew_by_group_s"] = _int_keyed(
            obj["rank_skew_by_group_s"], f"{where}: efficiency.rank_skew_by_group_s", zero=True)
    if "rank_compute_slowdown" in obj:
        out["rank_compute_slowdown"] = _int_keyed(obj["rank_compute_slowdown"],
                                                  f"{where}: efficiency.rank_compute_slowdown")
    return out


def parse_efficiency(obj: Any, sources: Mapping[str, Any], where: str) -> Efficiency:
    """``obj`` (a profile's ``efficiency`` object) checked against ``sources`` and parsed."""
    if not isinstance(obj, Mapping):
        raise EpsimError(f"{where}: efficiency must be an object")
    for key in EFFICIENCY_KEYS:
        if key not in obj:
            raise EpsimError(f"{where}: efficiency lacks required key {key!r}")
    fractions = obj["gemm_flops_fraction"]
    if not isinstance(fractions, Mapping) or not {"bf16", "fp8"} <= set(fractions):
        raise EpsimError(f"{where}: efficiency.gemm_flops_fraction must be an object with at "
                         "least bf16 and fp8")
    gemm = {d: number(fractions, d, f"{where}: efficiency.gemm_flops_fraction")
            for d in fractions}
    values: dict[str, Any] = {"gemm_flops_fraction": gemm}
    for key in EFFICIENCY_KEYS[1:]:
        values[key] = number(obj, key, f"{where}: efficiency")
    for key in ("gemm_flops_fraction", *_FRACTION_KEYS):
        numbers = gemm.values() if key == "gemm_flops_fraction" else [values[key]]
        if any(v > 1 for v in numbers):
            raise EpsimError(f"{where}: efficiency.{key} must be a fraction in (0, 1]")
    if values["comm_compute_slowdown"] >= 1:
        raise EpsimError(f"{where}: efficiency.comm_compute_slowdown must be below 1")
    values.update(_optional_efficiency(obj, where))
    present = [k for k in OPTIONAL_EFFICIENCY_KEYS if k in obj]
    missing = [k for k in (*EFFICIENCY_KEYS, *present) if not sources.get(f"efficiency.{k}")]
    if missing:
        raise EpsimError(f"{where}: sources lacks an entry for "
                         + ", ".join(f"efficiency.{k}" for k in missing))
    if "attention_decode_flops" in obj:
        table = obj["attention_decode_flops"]
        where_table = f"{where}: efficiency.attention_decode_flops"
        if not isinstance(table, Mapping) or not table:
            raise EpsimError(f"{where_table} must be an object {{kv dtype: FLOP/s}}")
        if not sources.get("efficiency.attention_decode_flops"):
            raise EpsimError(f"{where}: sources lacks an entry for efficiency.attention_decode_flops")
        values["attention_decode_flops"] = {str(k): number(table, k, where_table) for k in table}
    for key in ("gemm_tile_m", "attention_split_tokens"):  # counts: half a tile is no tile
        # (2**53: exact as a float; a fitted profile writes 2**30 for "never split")
        values[key] = check_count(values[key], 2**53, key, f"{where}: efficiency")
    return Efficiency(**values)

def number(obj: Mapping[str, Any], key: str, where: str) -> float:
    if key not in obj:
        raise EpsimError(f"{where}: profile lacks required key {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not MIN_PROFILE_NUMBER <= value <= MAX_PROFILE_NUMBER:
        raise EpsimError(f"{where}: {key} must be a positive number in [{MIN_PROFILE_NUMBER:g}, "
                         f"{MAX_PROFILE_NUMBER:g}], got {show(value)}")
    return float(value)

