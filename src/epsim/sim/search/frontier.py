"""The throughput/interactivity frontier: how users compare deployments on one chart.

    interactivity   output tok/s per user = 1000 / ``mean_tpot_ms``: the decode rate one request
                    sees (TPOT excludes the first token, so queueing and prefill do not enter it)
    per GPU         the run's ``output_throughput`` divided by its ``gpus`` (every GPU of the
                    deployment, both sides of a prefill:decode split)
    series          one line of the chart: the points of one hardware/engine/plan
    frontier        the points of a series that no other point of that series beats on both
                    axes (higher throughput per GPU and higher interactivity)
    $/M tokens      a GPU-hour price over the output tokens one GPU makes in an hour

The public InferenceMAX dashboards draw the same axes (throughput per GPU against tok/s/user,
one Pareto line per hardware and framework). Pure functions on result rows: no simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .slo import SLO, is_latency_key

#: the SLO metrics a vertical line stands for on the interactivity axis (per-token decode gaps)
DECODE_GAP_METRICS = ("tpot", "itl")


def interactivity(row: Mapping[str, Any]) -> float:
    """Output tok/s per user: 1000 / mean TPOT (ms). Example: 25 ms -> 40.0 tok/s/user; 0.0
    where no request has a second token (TPOT 0), so such a run sits at the axis' origin."""
    tpot = float(row["mean_tpot_ms"])
    return 1000.0 / tpot if tpot > 0 else 0.0


def throughput_per_gpu(row: Mapping[str, Any]) -> float:
    """Output tok/s over every GPU of the run. Example: 8,000 tok/s on 8 GPUs -> 1000.0."""
    return float(row["output_throughput"]) / int(row["gpus"])


def usd_per_million_tokens(tok_s_per_gpu: float, gpu_hour_usd: float | None) -> float | None:
    """USD per million output tokens at one GPU's rate (``None`` without a price or a rate).
    Example: 1000 tok/s/GPU at $2/GPU-hour -> 2 / 3.6 = $0.556/M."""
    if gpu_hour_usd is None or tok_s_per_gpu <= 0:
        return None
    return gpu_hour_usd / (tok_s_per_gpu * 3600.0) * 1e6


def pareto_mask(xs: Sequence[float], ys: Sequence[float]) -> list[bool]:
    """Which points no other point beats on both axes (higher is better on each); of equal
    points the first listed stands. Example: ``[(1, 3), (2, 2), (1, 1)]`` -> True, True, False."""
    order = sorted(range(len(xs)), key=lambda i: (-xs[i], -ys[i], i))
    keep = [False] * len(xs)
    best_y = None
    for i in order:  # right to left: a point stands if it is higher than all to its right
        if best_y is None or ys[i] > best_y:
            keep[i] = True
            best_y = ys[i]
    return keep


def frontier_points(rows: Sequence[Mapping[str, Any]],
                    series_of: Callable[[Mapping[str, Any]], str],
                    prices: Mapping[str, float] | None = None, carry: Sequence[str] = ()
                    ) -> list[dict[str, Any]]:
    """Every row as a point of its series (``series_of(row)``) on the chart's axes, marked
    ``on_frontier`` within its series and priced by ``prices`` (hardware name or ``"*"`` -> USD
    per GPU-hour), with the row's ``carry`` keys (what the point is: concurrency, split, ...).
    Sorted by series (first appearance), then interactivity."""
    prices = prices or {}
    series = [series_of(r) for r in rows]
    xs = [interactivity(r) for r in rows]
    ys = [throughput_per_gpu(r) for r in rows]
    on = [False] * len(rows)
    for name in dict.fromkeys(series):
        idx = [i for i, s in enumerate(series) if s == name]
        for i, keep in zip(idx, pareto_mask([xs[i] for i in idx], [ys[i] for i in idx]),
                           strict=True):
            on[i] = keep
    order = {name: n for n, name in enumerate(dict.fromkeys(series))}
    out = []
    for i in sorted(range(len(rows)), key=lambda i: (order[series[i]], xs[i], i)):
        price = prices.get(rows[i]["hardware"], prices.get("*"))
        out.append({"series": series[i], **{k: rows[i].get(k) for k in carry},
                    "interactivity_tok_s_user": xs[i], "output_tok_s_per_gpu": ys[i],
                    "on_frontier": on[i], "gpu_hour_usd": price,
                    "usd_per_million_output_tokens": usd_per_million_tokens(ys[i], price)})
    return out


def slo_interactivity(slo: SLO | None) -> list[tuple[str, float]]:
    """The SLO's upper bounds on a per-token decode gap (TPOT or ITL) as interactivity floors:
    ``[(term, 1000 / bound)]``. Example: ``mean_tpot_ms<=50`` -> ``[("mean_tpot_ms<=50",
    20.0)]``. A percentile or ITL bound is drawn at the same place, though the axis is the mean
    TPOT: a point right of it may still miss a ``p90`` bound (the table's ``meets_slo`` says)."""
    if slo is None:
        return []
    out = []
    for key, op, bound in slo.terms:
        if op in ("<=", "<") and is_latency_key(key) and bound > 0 \
                and key.split("_")[-2] in DECODE_GAP_METRICS:
            out.append((f"{key}{op}{bound:g}", 1000.0 / bound))
    return out
