"""``epsim tune``: the highest throughput whose percentiles meet an SLO, over a search space."""

from __future__ import annotations

import argparse
import time
from typing import Any

from epsim.sim.search.tune import TuneResult, tune

from ..common import (
    Progress,
    emit_json,
    print_columns,
)
from ..fidelity import SERVING_HEADLINE, band_text, regime_of, stamp
from ..frontier_chart import (
    add_frontier_args,
    check_prices,
    frontier_of,
    require_matplotlib,
    series_label,
    write_frontier_outputs,
)
from ..search_args import (
    DEFAULT_SEARCH_HARDWARE,
    add_search_args,
    executor_from_args,
    search_base_from_args,
    search_diagnostics,
    search_options_from_args,
    search_space_from_args,
)
from ..work import check_search


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune", help="best throughput meeting an SLO over concurrency, DBO, splits, KV, graph",
        description="Simulate every point of the search space (concurrency, DBO on/off, dp x tp "
        "splits, KV dtype, graph mode) and report the highest throughput whose metrics meet "
        "the SLO, with the throughput/latency frontier; --search bisect finds each "
        "deployment's highest concurrency or request rate within the SLO instead.")
    add_search_args(p)
    add_frontier_args(p)
    p.set_defaults(run=run)


COLS = ("concurrency", "dp", "tp", "ep", "dbo", "graph", "kv_dtype", "output_throughput",
        "decode_throughput", "median_ttft_ms", "p90_ttft_ms", "median_itl_ms", "meets_slo")


def summary(res: TuneResult, slo: str) -> dict[str, Any]:
    out = {"slo": slo, "objective": res.objective, "search": res.strategy, "best": res.best,
           "frontier": res.frontier, "points": res.points, "skipped": res.skipped}
    if res.strategy == "bisect":  # each deployment's highest load within the SLO
        out["boundaries"] = res.boundaries
    if res.best is not None:  # the band of the answer: the best point's regime
        b = res.best
        stamp(out, regime_of(ep=b["ep"], disaggregated=bool(b.get("disagg"))),
              SERVING_HEADLINE, figures=b)
    return out


def run(args: argparse.Namespace) -> int:
    slo = args.slo
    if args.plot:
        require_matplotlib()
    hardware = list(args.hardware or (DEFAULT_SEARCH_HARDWARE,))
    check_prices(args.gpu_hour_usd, hardware)
    space = search_space_from_args(args)
    base = search_base_from_args(args, hardware[0])
    check_search("tune", args, base, space)
    bar = Progress("tune", enabled=not args.json)
    t0 = time.perf_counter()
    try:
        with executor_from_args(args) as executor:
            res = tune(base, slo, space, objective=args.objective, num_prompts=args.num_prompts,
                       progress=bar, options=search_options_from_args(args, executor))
    finally:
        bar.close()
    # one series per hardware/engine: the best of every configuration at each interactivity
    points = frontier_of(res.points, lambda r: series_label(r, ()), args.gpu_hour_usd)
    write_frontier_outputs(args, points, res.points[0], "tune", slo)
    if args.json:
        emit_json({**summary(res, str(slo)), "interactivity_frontier": points,
                   "diagnostics": search_diagnostics(
            executor, res.strategy, time.perf_counter() - t0)})
        return 0
    cols = tuple(dict.fromkeys([*COLS[:-1], *(k for k, _, _ in slo.terms), COLS[-1]]))
    print(f"SLO {slo}; maximising {res.objective}; {len(res.points)} points simulated "
          f"({res.strategy} search)"
          + (f", {len(res.skipped)} skipped (first: {res.skipped[0]['reason']})"
             if res.skipped else ""))
    if res.best is None:
        print("no point meets the SLO; the frontier:")
    else:
        b = res.best
        rate = b.get("request_rate")  # the result's echo: a number, or "inf" (closed loop)
        rate = f", {rate:g} req/s" if isinstance(rate, float | int) else ""
        unit = "req/s" if res.objective == "request_goodput" else "tok/s"
        cap = "open loop" if b["concurrency"] is None else f"concurrency {b['concurrency']}"
        print(f"best: {cap}{rate}, dp {b['dp']} tp {b['tp']} "
              f"ep {b['ep']}, DBO {'on' if b['dbo'] else 'off'}, graph "
              f"{'on' if b['graph'] else 'off'}, KV {b['kv_dtype']}: "
              f"{b[res.objective]:,.1f} {unit} "
              + ", ".join(f"{k} {b[k]:.1f}" for k, _, _ in slo.terms))
        print(f"error band: {band_text(summary(res, str(slo))['error_band'])}")
        print("frontier (throughput vs " + res.latency + "):")
    print_columns(res.frontier, cols)
    print_boundaries(res.boundaries, args.sla_variable)
    return 0


def print_boundaries(rows: list[dict[str, Any]], variable: str) -> None:
    """Under --search bisect: each deployment's highest load meeting the SLO."""
    if not rows:
        return
    print(f"highest {variable} meeting the SLO, per deployment (bisection):")
    for row in rows:
        knobs = ", ".join(f"{k} {v}" for k, v in row["deployment"].items() if v is not None)
        found = "none" if row[variable] is None else f"{row[variable]:g}"
        print(f"  {knobs or 'the deployment'}: {found} ({row['probes']} probes)")
