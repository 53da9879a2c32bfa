"""A sanity guard on measured kernel tables: each point's implied efficiency against the roofline.

A point of a kernel table (``kernel_tables.Table``) times one op at one shape. The work that
shape must do, over the point's time, is a rate; over the device's peak it is the point's
*implied efficiency*::

    implied = max(flops / seconds / peak_flops[dtype], bytes / seconds / hbm_bandwidth)

(collectives: ``bytes / seconds`` over the fabric's per-GPU bandwidth, or the NIC's for an
``inter``-node table). The FLOPs and bytes are those ``model/graph_builder.py`` gives the op
(the cost model's roofline reads the same), each operand counted once:

* ``gemm`` (``m, n, k, batch``): ``2 b m n k`` FLOPs (no tile padding); bytes: weights and
  input at the table dtype's width, the output in BF16;
* ``grouped_gemm`` (fused MoE: ``tokens, experts, top_k, hidden, inter``): ``6 pairs hidden
  inter`` FLOPs (gate, up, down; ``pairs = tokens * top_k``); bytes: the experts the pairs
  reach times their three weight matrices at the table dtype's width, plus each pair's input
  row (table dtype) and output row (BF16). How many experts the pairs reach is the one count
  the features do not fix: as the cost model counts it (``op_kinds``: uniform routing,
  ``experts * (1 - (1 - 1/experts) ** pairs)``; the benchmarks route at random or balanced)
  for the implied efficiency, and at its least (every token on the same ``top_k`` experts:
  ``min(experts, top_k, ceil(pairs))``) for the refusal;
* ``attention_decode`` (MLA): ``2 batch query_tokens heads context (qk_dim + v_dim)`` FLOPs;
  bytes: the KV cache rows (``qk_dim`` wide, the table dtype is the cache's) and the BF16 query
  and output rows;
* ``attention_prefill`` (``qk_dim, v_dim, heads, context, batch, tokens``): the causal count
  ``2 heads batch (tokens p + tokens (tokens + 1) / 2) (qk_dim + v_dim)`` FLOPs (``p =
  context - tokens`` cached; the graph's count; a kernel benchmarked without the causal mask
  does more); bytes: each sequence's queries and outputs per head and its ``context`` keys and
  values once, at the table dtype's width (shared by the heads, as MLA's latent form and
  multi-query attention read them: the least any head layout reads);
* ``all_reduce``: ``2 (ranks - 1) / ranks * bytes`` reach each GPU on a full mesh (a
  bandwidth-optimal reduce-scatter then all-gather; a one-shot one moves more); through a switch
  that reduces in the fabric (NVSwitch's NVLS, NCCL's ``NVLS`` algorithm) only the reduced
  ``(ranks - 1) / ranks * bytes``; ``all_gather``: ``(ranks - 1) / ranks * bytes`` (the others'
  shares of the buffer);
* ``dispatch`` / ``combine`` are not judged: what an exchange sends depends on the routing's
  ``top_k`` and on whether rows are sent once per rank or once per expert, neither of which is a
  feature of the table, so its features give no lower bound on the bytes above zero.

A point whose *least* work (``strict``) is above ``1.0`` of the peaks cannot be true:
:func:`refuse` raises one line naming the table, the point and its source (for every kind but
the fused MoE the least work is the work counted). A point above ``1.0`` only as the cost model
counts the work (``BEYOND_MODEL``: the routing the cost model assumes would need more than the
device's bandwidth) is kept and flagged. A point below ``IMPLIED_EFFICIENCY_FLOOR`` is
kept and flagged, unless its work at peak is under ``FLOOR_MIN_WORK_S``: such a shape's time is
the kernel's launch-to-finish fixed cost, so its implied efficiency says nothing about the
measurement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from epsim.model.dtypes import BYTES_PER_ELEMENT, COMPUTE_DTYPE
from epsim.model.errors import EpsimError

from .kernel_tables import Table

#: below this implied efficiency a point is flagged: 1 % of both the FLOP and the HBM peak. No
#: kernel doing real work runs that far below both roofs (a skinny decode GEMM still streams
#: its weights at tens of percent of the HBM bandwidth), so such a point is more likely a
#: mislabelled shape or unit, or a kernel the deployment would not run, than a measurement to
#: trust. An assumption, not a measurement (docs/hardware.md, "Table guard").
IMPLIED_EFFICIENCY_FLOOR = 0.01
#: points whose work takes less than this at peak are exempt from the floor: a kernel's
#: launch-to-finish time has a fixed floor of a few microseconds on both vendors (docs/hardware.md:
#: kernel launch 4-4.5 us, graph node 1 us), so a tiny shape's implied efficiency measures that
#: fixed cost, not the kernel. An assumption (docs/hardware.md, "Table guard").
FLOOR_MIN_WORK_S = 1e-6
#: the roofs a point is judged against
BOUNDS = ("flops", "hbm", "fabric", "nic")
ABOVE_PEAK, BEYOND_MODEL, BELOW_FLOOR = "above_peak", "above_peak_as_modelled", "below_floor"
_OUT_BYTES = BYTES_PER_ELEMENT["bf16"]  # the kernels of the tables write BF16 activations
_SKIPPED = {"dispatch": "bytes sent depend on the routing's top_k and per-rank or per-expert "
                        "copies, not features of the table",
            "combine": "bytes sent depend on the routing's top_k and per-rank or per-expert "
                       "copies, not features of the table"}


@dataclass(frozen=True)
class Roof:
    """The peaks a point is judged against.

    peak_flops: dense peak FLOP/s per compute dtype. Example: ``{"bf16": 1.3074e15, ...}``.
    hbm_bandwidth: peak HBM bytes/s. fabric_bandwidth: peak bytes/s one GPU sends to its
    node's peers (all links together). nic_bandwidth: peak bytes/s per GPU off the node.
    switch_reduces: the intra-node fabric is a switch that can reduce in flight (NVSwitch).
    """

    peak_flops: Mapping[str, float]
    hbm_bandwidth: float
    fabric_bandwidth: float
    nic_bandwidth: float
    switch_reduces: bool = False

    def peak(self, dtype: str) -> float | None:
        """Peak FLOP/s of matrix ops on ``dtype`` storage (as ``HardwareProfile.peak``);
        None where the profile has none."""
        compute = COMPUTE_DTYPE.get(dtype, dtype)
        if compute in self.peak_flops:
            return self.peak_flops[compute]
        if compute == "fp16" and "bf16" in self.peak_flops:
            return self.peak_flops["bf16"]
        return None


@dataclass(frozen=True)
class Verdict:
    """One point the guard refused or flagged.

    table: its place (``kernels.sets.sglang.tables[2]``); point: its index; features:
    ``{name: value}``; seconds; source: its source id; efficiency: implied; bound: the roof
    it was judged on (``BOUNDS``); verdict: ``ABOVE_PEAK`` (refused), ``BEYOND_MODEL`` or
    ``BELOW_FLOOR`` (flagged).
    """

    table: str
    point: int
    features: Mapping[str, float]
    seconds: float
    source: str
    efficiency: float
    bound: str
    verdict: str

    def line(self, cite: str = "") -> str:
        feats = ", ".join(f"{k} {v:g}" for k, v in self.features.items())
        what = {ABOVE_PEAK: "above the device's peak even at the least work its shape can do",
                BEYOND_MODEL: "above the device's peak as the cost model counts the work",
                BELOW_FLOOR: f"below the {IMPLIED_EFFICIENCY_FLOOR:.0%} floor"}[self.verdict]
        src = f"source {self.source}" + (f" ({cite})" if cite else "")
        return (f"{self.table}.points[{self.point}] ({feats}: {self.seconds * 1e6:.4g} us) "
                f"implies {self.efficiency:.1%} of the {self.bound} roof, {what}; {src}")


def _col(table: Table, name: str) -> np.ndarray:
    return table.x[:, table.features.index(name)]


def _elem(dtype: str) -> float:
    return BYTES_PER_ELEMENT.get(dtype, BYTES_PER_ELEMENT["bf16"])


def work(table: Table, switch_reduces: bool = False, strict: bool = False
         ) -> tuple[np.ndarray, np.ndarray, str] | None:
    """``(flops, bytes, bytes roof)`` per point: the work at each point's shape (module
    docstring; ``strict``: the least it can be); the bytes roof is ``"hbm"``, ``"fabric"`` or
    ``"nic"``. None for a kind the guard does not judge."""
    op, w = table.op, _elem(table.dtype)
    if op == "gemm":
        m, n, k, b = (_col(table, c) for c in ("m", "n", "k", "batch"))
        return 2.0 * b * m * n * k, b * (n * k * w + m * k * w + m * n * _OUT_BYTES), "hbm"
    if op == "grouped_gemm":
        tokens, experts, top_k, h, i = (_col(table, c) for c in
                                        ("tokens", "experts", "top_k", "hidden", "inter"))
        pairs = tokens * top_k
        if strict:  # every token on the same top_k experts
            active = np.minimum(np.minimum(experts, top_k), np.maximum(np.ceil(pairs), 1.0))
        else:
            active = np.where(experts > 1, experts * (1.0 - (1.0 - 1.0 / experts) ** pairs),
                              np.minimum(pairs, 1.0))
        moved = active * 3.0 * h * i * w + pairs * h * (w + _OUT_BYTES)
        return 6.0 * pairs * h * i, moved, "hbm"
    if op == "attention_decode":
        b, c, h, q, qk, v = (_col(table, n) for n in ("batch", "context", "heads",
                                                      "query_tokens", "qk_dim", "v_dim"))
        moved = b * c * qk * w + b * q * h * (qk + v) * _OUT_BYTES
        return 2.0 * b * q * h * c * (qk + v), moved, "hbm"
    if op == "attention_prefill":
        qk, v, h, c, b, t = (_col(table, n) for n in ("qk_dim", "v_dim", "heads", "context",
                                                      "batch", "tokens"))
        cached = np.maximum(c - t, 0.0)
        flops = 2.0 * h * b * (t * cached + t * (t + 1.0) / 2.0) * (qk + v)
        return flops, b * (h * t + c) * (qk + v) * w, "hbm"
    if op in ("all_reduce", "all_gather"):
        ranks, size = _col(table, "ranks"), _col(table, "bytes")
        twice = op == "all_reduce" and not (switch_reduces and table.scope == "intra")
        share = (ranks - 1.0) / ranks * (2.0 if twice else 1.0)
        return np.zeros(len(table)), share * size, "nic" if table.scope == "inter" else "fabric"
    return None


def skipped(op: str) -> str:
    """Why the guard does not judge ``op``'s tables ("" where it does)."""
    return _SKIPPED.get(op, "")


def implied(table: Table, roof: Roof, strict: bool = False
            ) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
    """``(implied efficiency, seconds of the work at peak, the roof that binds)`` per point
    (``strict``: of the least work); None for a kind the guard does not judge."""
    got = work(table, roof.switch_reduces, strict)
    if got is None:
        return None
    flops, moved, where = got
    bandwidth = {"hbm": roof.hbm_bandwidth, "fabric": roof.fabric_bandwidth,
                 "nic": roof.nic_bandwidth}[where]
    peak = roof.peak(table.dtype)
    t_flops = flops / peak if peak else np.zeros(len(table))
    t_bytes = moved / bandwidth
    ideal = np.maximum(t_flops, t_bytes)
    bound = ["flops" if f > b else where for f, b in zip(t_flops.tolist(), t_bytes.tolist(),
                                                           strict=True)]
    return ideal / table.seconds, ideal, bound


def judge(table: Table, roof: Roof) -> list[Verdict]:
    """The points of ``table`` above peak (at their least work: ``ABOVE_PEAK``; as the cost
    model counts it: ``BEYOND_MODEL``) or, with enough work to matter, below the floor."""
    got = implied(table, roof)
    if got is None:
        return []
    eff, ideal, bound = got
    least = implied(table, roof, strict=True)[0]
    out = []
    for i in np.flatnonzero((eff > 1.0) | ((eff < IMPLIED_EFFICIENCY_FLOOR)
                                           & (ideal >= FLOOR_MIN_WORK_S))).tolist():
        verdict = BELOW_FLOOR if eff[i] <= 1.0 else (
            ABOVE_PEAK if least[i] > 1.0 else BEYOND_MODEL)
        value = least[i] if verdict == ABOVE_PEAK else eff[i]
        out.append(Verdict(table.where, i, dict(table.point(i)["features"]),
                           float(table.seconds[i]), table.sources[i], float(value), bound[i],
                           verdict))
    return out


def refuse(tables: Iterable[Table], roof: Roof, cite: Mapping[str, str] | None = None,
           where: str = "") -> tuple[Verdict, ...]:
    """Judge every table: a point above peak is an :class:`EpsimError` (one line: the table,
    the point, its source); returns the points below the floor (kept, flagged)."""
    flagged: list[Verdict] = []
    for table in tables:
        for v in judge(table, roof):
            if v.verdict == ABOVE_PEAK:
                prefix = f"{where}: " if where else ""
                raise EpsimError(f"{prefix}{v.line((cite or {}).get(v.source, ''))}; a "
                                 "measurement cannot beat the device's peak (refused)")
            flagged.append(v)
    return tuple(flagged)


def point_efficiency(table: Table, i: int, roof: Roof) -> dict[str, Any] | None:
    """Point ``i``'s ``{"implied_efficiency", "bound", "below_floor"}`` (``--explain``); None
    where the kind is not judged."""
    got = implied(table, roof)
    if got is None:
        return None
    eff, ideal, bound = got
    low = bool(eff[i] < IMPLIED_EFFICIENCY_FLOOR and ideal[i] >= FLOOR_MIN_WORK_S)
    return {"implied_efficiency": float(eff[i]), "bound": bound[i], "below_floor": low}
